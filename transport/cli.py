"""The ``pxn`` command line: ``pxn topo`` (topology and routes) and ``pxn bench`` (the main benchmark).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only dispatches. Exit codes: 0 success, 1 a benchmark's byte-exact check failed, 2 bad input / environment
(a malformed ``PXN_*`` variable too), or stdout closed early, 130 interrupted.

Every refusal is one line on stderr, ``pxn <command>: error: <what>: <why>``, naming the flag or variable and
its value; argparse's own refusals too (with a hint where ``--help`` is). "unexpected" is kept for a bug in pxn,
whose traceback ``pxn --traceback ...`` shows.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import stat
import sys
import threading
import time

from transport.errors import PxnError

SUBCOMMANDS = {
    "topo": ("transport.topo_cli", "show GPUs, NIC ports, distance classes and each GPU's rails"),
    "bench": ("transport.bench_cli", "run the main benchmark (default: sglang transfer shapes)"),
}


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def version() -> str:
    """The version of the pxn code that runs (``transport.__version__``, which setup.py installs under)."""
    from transport import __version__
    return __version__


def _start_thread_without_sigint(target, args, name: str) -> None:
    """A daemon thread started with SIGINT blocked, which it keeps: a Ctrl-C goes to the main thread, which may
    hold it back while it imports torch (``bench_cli._import_torch``)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _StdoutWatch:
    """Notices a reader of stdout that went away (``pxn bench | head -1``) while the command is still working
    and has nothing to print, and interrupts the main thread at once instead of at the next line.

    Only for a pipe; the interruption is told apart from a Ctrl-C by ``gone``."""

    def __init__(self):
        self.gone = threading.Event()
        self.done = threading.Event()

    def start(self) -> None:
        """Start watching (inside the caller's try: the interruption may come before this returns)."""
        try:
            fd = sys.stdout.fileno()
            if not stat.S_ISFIFO(os.fstat(fd).st_mode) or not hasattr(select, "poll"):
                return
        except (OSError, ValueError, AttributeError):
            return  # not a real file (captured), or closed
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR (the read end is closed) and POLLHUP are reported without asking
        _start_thread_without_sigint(self._watch, (poller,), "pxn-stdout-watch")

    def _watch(self, poller) -> None:
        while not self.done.is_set():
            if poller.poll(200):
                if not self.done.is_set():
                    self.gone.set()
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return


class _Parser(argparse.ArgumentParser):
    """argparse in pxn's voice: a refusal is one line naming the command, and where to read the options (not
    argparse's usage block). Subcommand parsers are of this class too (``add_subparsers`` uses the parent's)."""

    def error(self, message):
        if message.startswith("argument "):  # "argument --rails: invalid int value: 'x'": the flag leads
            message = message[len("argument "):]
        self.exit(2, "%s: error: %s (%s --help lists the options)\n" % (self.prog, message, self.prog))


def _first_line(e: BaseException) -> str:
    """An error's message as one line (a peer's error carries its traceback after the first line)."""
    return (str(e).strip().splitlines() or [""])[0]


class _CtrlC:
    """``main``'s Ctrl-C: one line, at any moment.

    The handler raises ``KeyboardInterrupt`` wherever the main thread is, and CPython swallows an exception raised
    inside a weakref callback or a ``__del__`` (it prints "Exception ignored in: ..." and goes on): a Ctrl-C that
    lands in, say, the import system's module-lock callback would be lost, and the run would go on. While
    installed, such a swallowed interrupt is not printed but sent again to the main thread, from another thread,
    to be raised outside the callback."""

    def __init__(self):
        self.installed = False
        self.caught = False  # main has the interrupt: a later swallowed one is teardown's, not to raise again
        self._previous_hook = None
        self._again = threading.Event()
        self._closed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # a program with its own Ctrl-C handling keeps it
        _start_thread_without_sigint(self._send_again, (), "pxn-ctrl-c-again")
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        signal.signal(signal.SIGINT, self._interrupted)
        self.installed = True

    def uninstall(self) -> None:
        """Puts Python's own behaviour back (``main`` called in-process, by a program or a test)."""
        self._closed = True
        self._again.set()
        if self.installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = self._previous_hook
            self.installed = False

    @staticmethod
    def _interrupted(signum, frame):
        # the run's teardown (peers closed while batches are in flight) is not news after a Ctrl-C, so nothing
        # is logged from here on; the one line is main's
        logging.disable(logging.CRITICAL)
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        # as little as possible here: a signal handled inside this hook would be swallowed (and printed) too
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._again.set()
        else:
            self._previous_hook(unraisable)

    def _send_again(self) -> None:
        while True:
            self._again.wait()
            if self._closed:
                return
            self._again.clear()
            time.sleep(0.01)  # the main thread is out of the hook (and, most likely, out of the callback)
            if not (self.caught or self._closed):
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def main(argv=None) -> int:
    traceback_wanted, ctrl_c = False, None
    try:  # from the first line: a Ctrl-C at any moment is one line
        argv = sys.argv[1:] if argv is None else list(argv)
        traceback_wanted = "--traceback" in argv
        ctrl_c = _CtrlC()
        ctrl_c.install()
        return _main(argv, _chosen(argv), ctrl_c)
    except KeyboardInterrupt:  # before a subcommand runs (its import, the parsing): one line too
        if ctrl_c is not None:
            ctrl_c.caught = True
        print("%s: interrupted" % _prog(argv), file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the promise is one line, never a traceback
        if traceback_wanted:
            raise
        print("%s: unexpected %s: %s (pxn --traceback ... shows where)" % (_prog(argv), type(e).__name__,
                                                                            _first_line(e)), file=sys.stderr)
        return 2
    finally:
        if ctrl_c is not None:
            ctrl_c.uninstall()


def _chosen(argv: list):
    """The subcommand named in ``argv`` (the first word that is not an option), or None."""
    return next((arg for arg in argv if isinstance(arg, str) and not arg.startswith("-")), None)


def _prog(argv) -> str:
    """``pxn <subcommand>`` for messages, ``pxn`` when none is named (or ``argv`` is not a list of words: the
    message then is about that)."""
    words = sys.argv[1:] if argv is None else argv
    chosen = _chosen(words) if isinstance(words, list) else None
    return "pxn %s" % chosen if chosen in SUBCOMMANDS else "pxn"


def _main(argv, chosen, ctrl_c: _CtrlC) -> int:
    parser = _Parser(prog="pxn", description="pxn: PXN relay for KV-cache transfer")
    parser.add_argument("--version", action="version", version="pxn " + version())
    parser.add_argument("--traceback", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only the chosen subcommand's module is imported: one broken or heavy subcommand never takes the
    # others down with it (``pxn topo`` must work on a machine where the engine cannot start).
    module = chosen_parser = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module, chosen_parser = importlib.import_module(module_name), sub_parser
            module.add_arguments(sub_parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's own usage, not the top level's (argparse would blame ``pxn`` itself).
        (chosen_parser or parser).error("unrecognized arguments: %s" % " ".join(unknown))
    prog = "pxn %s" % args.command
    watch = _StdoutWatch()
    try:
        watch.start()
        return int(module.run(args) or 0)
    except BrokenPipeError:
        _quiet_stdout()
        print("%s: output closed early (broken pipe)" % prog, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        ctrl_c.caught = True
        if watch.gone.is_set():
            _quiet_stdout()
            print("%s: output closed early (broken pipe)" % prog, file=sys.stderr)
            return 2
        print("%s: interrupted" % prog, file=sys.stderr)
        return 130
    except PxnError as e:  # a malformed setting (ConfigError), a fabric this machine cannot run: the user's to fix
        print("%s: error: %s" % (prog, _first_line(e)), file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the promise is one line, never a traceback
        if args.traceback:
            raise
        print("%s: unexpected %s: %s (pxn --traceback %s ... shows where)" % (prog, type(e).__name__,
                                                                          _first_line(e), args.command),
              file=sys.stderr)
        return 2
    finally:
        watch.done.set()


if __name__ == "__main__":
    sys.exit(main())
