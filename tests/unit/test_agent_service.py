"""AgentService hands each RPC to one handler object (agent/rpc_*.py): every RPC of the proto is
served, by exactly the handler that defines it, and no handler keeps state under a method's name
(a cache named `_digest` once turned PutFile and GetFileDigest into "'tuple' object is not callable",
when the handlers were mixins sharing one instance)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

import pytest

from agent import service
from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc

pytestmark = pytest.mark.unit

RPCS = [method.name for method in pb.DESCRIPTOR.services_by_name["Agent"].methods]
HANDLER_CLASSES = typing.get_type_hints(service.AgentHandlers)  # field name -> handler class


def serving_handlers(rpc: str) -> list[str]:
    return [field for field, cls in HANDLER_CLASSES.items() if callable(getattr(cls, rpc, None))]


class Recorder:
    """Stands in for one handler: records each RPC asked of it."""

    def __init__(self, field: str, calls: list):
        self._field = field
        self._calls = calls

    def __getattr__(self, rpc: str):
        def serve(request, context):
            self._calls.append((self._field, rpc, request, context))
            return f"{self._field}.{rpc}"
        return serve


def test_the_proto_has_the_rpcs_this_test_expects() -> None:
    assert len(RPCS) == 24 and {"GetStatus", "StartRank", "WatchMemory", "CollectDiagnostics"} <= set(RPCS)


@pytest.mark.parametrize("rpc", RPCS)
def test_each_rpc_is_defined_by_exactly_one_handler(rpc: str) -> None:
    assert len(serving_handlers(rpc)) == 1, (rpc, serving_handlers(rpc))


def test_no_handler_defines_an_rpc_the_proto_lacks() -> None:
    public = {name for cls in HANDLER_CLASSES.values() for name in vars(cls)
              if name[:1].isupper() and callable(vars(cls)[name])}
    assert public == set(RPCS)


@pytest.mark.parametrize("rpc", RPCS)
def test_the_servicer_hands_each_rpc_to_the_handler_that_defines_it(rpc: str) -> None:
    assert rpc in vars(service.AgentService), f"{rpc} would answer UNIMPLEMENTED"
    calls: list = []
    handlers = service.AgentHandlers(**{field: Recorder(field, calls) for field in HANDLER_CLASSES})
    request, context = object(), object()
    [owner] = serving_handlers(rpc)
    assert getattr(service.AgentService(handlers), rpc)(request, context) == f"{owner}.{rpc}"
    assert calls == [(owner, rpc, request, context)]


def test_the_servicer_is_the_grpc_servicer_of_the_proto() -> None:
    assert issubclass(service.AgentService, agent_pb2_grpc.AgentServicer)
    assert [f.name for f in dataclasses.fields(service.AgentHandlers)] == list(HANDLER_CLASSES)


@pytest.mark.parametrize("cls", [service.AgentService, *HANDLER_CLASSES.values()], ids=lambda c: c.__name__)
def test_no_instance_attribute_shadows_a_method(cls) -> None:
    tree = ast.parse(inspect.getsource(cls))
    assigned = {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"}
    methods = {name for klass in cls.__mro__ if klass is not object
               for name, value in vars(klass).items() if callable(value) or isinstance(value, (staticmethod, classmethod))}
    assert assigned and not assigned & methods, sorted(assigned & methods)
