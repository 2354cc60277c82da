"""A pack layer's state as the agents report it, read from the typed field (pure helpers)."""

from __future__ import annotations

from dsv41.v1 import agent_pb2 as pb

# An agent older than PackLayerState.state_kind sends only the state's value (the agent's fixed
# vocabulary, agent/pack/state.py Status), which maps one to one.
_STATE_VALUES = {"absent": pb.PackLayerState.ABSENT, "packing": pb.PackLayerState.PACKING,
                 "complete": pb.PackLayerState.COMPLETE, "stale": pb.PackLayerState.STALE,
                 "corrupt": pb.PackLayerState.CORRUPT}


def layer_state(layer: pb.PackLayerState) -> int:
    """The layer's PackLayerState.State."""
    if layer.state_kind != pb.PackLayerState.STATE_UNSPECIFIED:
        return layer.state_kind
    return _STATE_VALUES.get(layer.state, pb.PackLayerState.STATE_UNSPECIFIED)


def incomplete(state: pb.PackState) -> list[pb.PackLayerState]:
    return [layer for layer in state.layers if layer_state(layer) != pb.PackLayerState.COMPLETE]
