"""The scoring process of `isolation.py`, run by path (`python isolation_child.py FD DUMP_FD`), not imported.

It imports the standard library only (importing `posttrain.rewards` would pull in torch and cost seconds at
every start and every restart after a timeout), then the user's reward file by path. Protocol on the socket
FD, one pickled message each (multiprocessing.connection framing):

    parent -> ("init", {"path", "name", "sys_path"})   child -> ("ready", None) | ("failed", traceback)
    parent -> ("score", [kwargs, ...])                 child -> one reply per row, in order:
        ("ok", value) | ("error", type name, message, traceback, is the project's ConfigError)

SIGUSR1 writes the Python stack to DUMP_FD (faulthandler, so it works inside C code and busy loops too):
the parent asks for it before killing a call that timed out, to show where the call hung.
"""

import faulthandler
import hashlib
import importlib.util
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when the driver dies, even in the middle of a call that never returns."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed socket still ends an idle child
        pass
    if os.getppid() != parent:
        os._exit(1)


def _load(path: str, name: str):  # noqa: ANN202  (as rewards/user.py: a module name derived from the path)
    file = os.path.realpath(os.path.expanduser(path))
    digest = hashlib.sha1(file.encode()).hexdigest()[:10]
    module_name = f"posttrain_user_reward_{os.path.splitext(os.path.basename(file))[0]}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _error(exc: BaseException, skip_frames: int = 0) -> tuple:
    config = type(exc).__name__ == "ConfigError" and type(exc).__module__ == "posttrain.errors"
    tb = exc.__traceback__
    for _ in range(skip_frames):  # this file's own frames: the traceback starts in the user's file
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return ("error", type(exc).__name__, str(exc), text, config)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    faulthandler.register(signal.SIGUSR1, file=os.fdopen(int(sys.argv[2]), "w"), all_threads=True)
    _die_with_parent()
    _, init = conn.recv()
    sys.path[:] = init["sys_path"]  # the driver's: the user's file imports what it would import there
    try:
        fn = _load(init["path"], init["name"])
    except BaseException as exc:  # noqa: BLE001  (reported to the driver, which raises)
        conn.send(("failed", "".join(traceback.format_exception(exc))))
        return
    conn.send(("ready", None))
    while True:
        try:
            _, rows = conn.recv()
        except EOFError:  # the driver closed the socket (or died)
            return
        for kwargs in rows:
            try:
                reply = ("ok", fn(**kwargs))
            except Exception as exc:  # noqa: BLE001  (one row's failure, sent to the driver)
                reply = _error(exc, skip_frames=1)
            try:
                conn.send(reply)
            except Exception as exc:  # noqa: BLE001  (a value that cannot be pickled)
                conn.send(_error(TypeError(f"returned a value that cannot be sent to the driver: {exc}")))


if __name__ == "__main__":
    main()
