"""A gRPC call's failure, as the coordinator's AgentClient receives it, for tests over fake agents."""

import grpc


class RpcFailure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Aborted(Exception):
    """What a servicer's context.abort raises here: (status code, details)."""


class AbortContext:
    """The servicer's side of a call: abort() ends the handler as gRPC's does."""

    def abort(self, code, message):
        raise Aborted(code, message)
