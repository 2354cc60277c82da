"""Reading the SGLang API key from the file named by DSV41_API_KEY_FILE.

The coordinator puts the key on the head node as a 0600 file and names it in the rank's
environment; the key itself never goes into argv (visible to every local user in ps and
/proc/PID/cmdline) nor into the environment (systemctl show prints it). Both the adapter inside
SGLang (adapter/api_key.py) and the stand-in engine (sim/) read it through read_key_file, so they
refuse the same files with the same words.

Every refusal names the variable, the path and what is wrong, and never quotes the file's content.
Standard library only: this module is imported outside SGLang too.
"""

from __future__ import annotations

import errno
import os
import re
import stat

VARIABLE = "DSV41_API_KEY_FILE"
# What coordinator/pki.py read_api_key accepts on the head: printable ASCII without spaces (it
# travels in an HTTP header), 8 to 4096 characters.
_KEY = re.compile(r"[\x21-\x7e]+")
MIN_LENGTH = 8
MAX_LENGTH = 4096
_READ_LIMIT = MAX_LENGTH + 3  # the key, "\r\n", and one byte to notice a longer file


class KeyFileError(ValueError):
    """The key file cannot be used; str() is the whole message (variable, path, what is wrong)."""


def read_key_file(path: str, variable: str = VARIABLE) -> str:
    """The key held by `path`: a regular file owned by root or this process's user, not readable by
    group or other, holding one line of 8 to 4096 printable ASCII characters without spaces (a final
    newline is allowed)."""

    def refuse(what: str) -> KeyFileError:
        return KeyFileError(f"{variable}={path}: {what}")

    if not path.strip():
        raise KeyFileError(f"{variable} is set but empty: it must name the file holding the API key")
    if not os.path.isabs(path):
        raise refuse("not an absolute path")
    try:
        # O_NONBLOCK: a FIFO at the path must not hang the rank (it is refused below).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise refuse("no such file (the coordinator puts the key there before it starts rank 0)") from None
        raise refuse(f"cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the name points at later
        if not stat.S_ISREG(st.st_mode):
            raise refuse("not a regular file")
        if st.st_mode & 0o077:
            raise refuse(f"mode {st.st_mode & 0o777:04o} lets group or other read the key; it must be 0600")
        if st.st_uid not in (0, os.geteuid()):
            # Its owner could swap the key, or loosen the mode, under a running server.
            raise refuse(f"owned by uid {st.st_uid}; it must be owned by root or by the rank's user "
                         f"(uid {os.geteuid()})")
        data = os.read(fd, _READ_LIMIT)
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if not data.strip(b"\r\n"):
        raise refuse("empty (it must hold the key on one line)")
    if len(data) == _READ_LIMIT:
        raise refuse(f"longer than {MAX_LENGTH} characters (it must hold only the key, on one line)")
    text = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    if b"\n" in text or b"\r" in text:
        raise refuse("more than one line (it must hold only the key, on one line)")
    if any(b > 0x7E for b in text):
        raise refuse("not ASCII (the key must be printable ASCII without spaces)")
    key = text.decode("ascii")
    if not _KEY.fullmatch(key):
        raise refuse("holds spaces or control characters (the key must be printable ASCII without spaces)")
    if len(key) < MIN_LENGTH:
        raise refuse(f"the key is shorter than {MIN_LENGTH} characters")
    if len(key) > MAX_LENGTH:
        raise refuse(f"longer than {MAX_LENGTH} characters (it must hold only the key, on one line)")
    return key
