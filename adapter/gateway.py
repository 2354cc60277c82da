"""SGLang's model gateway (sglang-router 0.3.2) with the cluster's API key read from a file.

Run by the agent as the unit dsv41-gateway.service on the head (agent/gateway.py), in the head
rank's runtime or in GATEWAY_PYTHON, in place of `python -m sglang_router.launch_router`:
    python -m adapter.gateway --host H --port P --prometheus-host 127.0.0.1 --prometheus-port Q ...
The flags are sglang_router.launch_router's own (parse_router_args), but the key never comes from
them: `--api-key K` would show it to every local user (ps, /proc/PID/cmdline) and in the unit's
recorded command line. With DSV41_API_KEY_FILE set (the head rank's environment carries it), the
router's api_key is read from that 0600 file (adapter/keyfile.py: the rank's own rules); without
it, the gateway asks for no key. Exit status 2, with the reason on stderr, for a key file that
cannot be used or a key given on the command line. Imports only the standard library and the
adapter's key-file reader before sglang_router.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from adapter.keyfile import VARIABLE, KeyFileError, read_key_file

PROG = "python -m adapter.gateway"
FROM_FILE = f"the key comes from {VARIABLE}"


class Refused(Exception):
    """The gateway must not start; str() is the reason for stderr."""


def router_args(argv: Sequence[str], environ: dict[str, str], parse) -> object:
    """The router's RouterArgs from argv (parse: sglang_router.launch_router.parse_router_args),
    with api_key from the file named by DSV41_API_KEY_FILE when that is set."""
    args = parse(list(argv))
    # Whatever spelling argparse accepted (--api-key K, --api-key=K, an abbreviation), it landed here.
    if args.api_key is not None or args.control_plane_api_keys:
        raise Refused(f"{PROG}: --api-key and --control-plane-api-keys are refused on the command line: "
                      f"{FROM_FILE} (a 0600 file holding the key on one line)")
    if VARIABLE in environ:
        try:
            args.api_key = read_key_file(environ[VARIABLE])
        except KeyFileError as exc:
            raise Refused(f"{PROG}: {exc}") from None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from sglang_router.launch_router import launch_router, parse_router_args

    try:
        args = router_args(sys.argv[1:] if argv is None else argv, dict(os.environ), parse_router_args)
    except Refused as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    launch_router(args)  # serves until SIGTERM, then drains for --shutdown-grace-period-secs
    return 0


if __name__ == "__main__":
    sys.exit(main())
