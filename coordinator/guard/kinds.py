"""The guard's vocabulary: its phases, what a decision does, what saw the danger, why a request
was chosen. String enums: their values are what the journal events carry."""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    ARMED = "armed"              # watching; the next danger is acted on
    ABORTED = "aborted"          # requests aborted by rid: confirm, re-arm, or escalate
    ABORTED_ALL = "aborted_all"  # everything aborted: re-arm, or stop the ranks
    STOPPED = "stopped"          # the ranks were asked to stop: nothing more to do in this run


class Kind(enum.StrEnum):
    NONE = "none"
    NEED_INFLIGHT = "need_inflight"  # internal: ask again with rank 0's in-flight list
    ABORT = "abort"
    ABORT_ALL = "abort_all"
    STOP = "stop"
    REARM = "rearm"
    HOLD = "hold"  # danger by the trend, but the requests' cost says the fall ends above the guard


ACTIONS = frozenset({Kind.ABORT, Kind.ABORT_ALL, Kind.STOP})


class Basis(enum.StrEnum):
    """What saw the crossing coming."""
    SLOPE = "slope"  # the line through the recent samples
    LOWS = "lows"    # the line through the recent lows
    MODEL = "model"  # the requests' cost (the early check)
    LOOK = "look"    # a waiting request that cannot fit (the look between samples)


class Why(enum.StrEnum):
    """Why a request is a victim."""
    GROWING = "growing"        # it is being prefilled
    CANNOT_FIT = "cannot_fit"  # it waits, and its peak cannot fit in what is left
    HOLDS = "holds"            # it holds memory the others need
    UNBLOCKS = "unblocks"      # aborted first, so that a request whose rid it starts with can be


class Mode(enum.StrEnum):
    ACT = "act"
    OBSERVE = "observe"  # log what it would do
    OFF = "off"
