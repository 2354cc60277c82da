"""What a rank's own output says about why its run ended: a collective that failed because a peer
went away. Such a rank followed another's failure, whatever the order its node saw things in.

Seen on SGLang 0.5.23 over gloo (kill -9 of rank 0's scheduler): each worker's scheduler logged
"Scheduler hit an exception", its traceback ending in

    RuntimeError: [.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer
    [192.168.241.11]:42374. This is typically caused by a remote worker crashing. ...

(or "Read error [ADDR]:PORT: Connection reset by peer"), and its launcher killed its own tree at
once; rank 0's scheduler, killed, logged nothing. NCCL says the same in its own words: the
ncclRemoteError string "remote process exited or there was a network error", and its socket
transport's "Connection closed by remote peer".
"""

from __future__ import annotations

import re
from typing import Iterable

_COLLECTIVE = re.compile(r"gloo|nccl", re.IGNORECASE)
_PEER_GONE = re.compile(r"(closed|reset) by (remote )?peer|remote process exited or there was a network error")
_GLOO_PREFIX = re.compile(r".*gloo/transport/\S+\] ")
MAX_CHARS = 200


def peer_failure(messages: Iterable[str]) -> str:
    """The first line in which the rank's collective library says a peer went away, shortened to
    what it says (gloo's source location and advice cut off); "" when there is none. A line must
    name the library (gloo or NCCL): an HTTP client's reset connection is not a peer's failure."""
    for message in messages:
        if _COLLECTIVE.search(message) and _PEER_GONE.search(message):
            said = _GLOO_PREFIX.sub("", message, count=1).split(". This is typically", 1)[0]
            return said.strip()[:MAX_CHARS]
    return ""
