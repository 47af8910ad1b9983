"""The ``fxreplace`` command: demo, capture, validate, blame, repro, inspect.

Exit codes: 0 success (every ``--fail-on`` gate passed); 1 a check failed (a ``--fail-on``
gate, or ``inspect --verify`` found a damaged store); 2 a user's mistake (a bad argument, a
missing file or extra, a wrong target, an unwritable folder): one ``error:`` line that names
the problem and the fix; 3 an internal error (fxreplace's fault: one line, ``--debug`` for
the traceback); 130 interrupted (Ctrl-C). Every failure after the arguments are parsed is
one line that ends with what the run left on disk (:class:`~fxreplace.cli.args.Produced`).

One module per command parses nothing itself: :mod:`.parser` declares every command's
arguments and names the function that runs it (``module:function``), which :func:`main`
imports when the command runs, so ``--help`` and argument mistakes answer before torch loads.
"""


from __future__ import annotations

import importlib
import sys
import traceback

from ..loading import SetupError
from ..words import one_line
from .args import EXIT_INTERNAL, EXIT_INTERRUPTED, Produced, UsageError, say_interrupted
from .parser import build_parser

HF_EXTRA = {"transformers", "tqdm", "matplotlib"}  # the `hf` extra: every command needs it

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr (``--debug`` adds the traceback)
    and an exit code of its own: a user's mistake raises :class:`UsageError` (2), an
    interrupt exits 130 and an internal error 3, each line ending with what was left on disk."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    produced = Produced()
    try:
        args = build_parser().parse_args(argv)
        args.produced = produced
        from ..config import ConfigError  # after the parse: --help answers without loading torch
        from ..targets import TargetError

        module, _, function = args.handler.partition(":")
        try:
            return getattr(importlib.import_module(module), function)(args)
        except SetupError as e:  # what the command was given cannot be used (the library's words)
            raise UsageError(e.problem, e.hint) from None
        except (TargetError, ConfigError) as e:  # a --target that names no module, a bad replacement config
            raise UsageError(str(e), f"`fxreplace inspect {getattr(args, 'model', None) or 'MODEL'}` lists the "
                             "injection points") from e
        except ModuleNotFoundError as e:
            if e.name not in HF_EXTRA:
                raise
            raise UsageError(f"fxreplace {argv[0]} needs {e.name}", "pip install 'fxreplace[hf]'") from None
        except OSError as e:  # the environment's: a full disk, a folder removed or made read-only meanwhile
            raise UsageError(f"{one_line(e)}; {produced}") from e
    except UsageError as error:
        if debug:
            traceback.print_exc()
        print(error, file=sys.stderr)
        raise
    except KeyboardInterrupt as interrupt:
        if debug:
            traceback.print_exc()
        # what the interrupted frames held open goes now: a progress bar closed at exit would print below this line
        traceback.clear_frames(interrupt.__traceback__)
        say_interrupted(produced)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as error:  # noqa: BLE001 - fxreplace's own fault: one line, the traceback on demand
        if debug:
            traceback.print_exc()
        print(f"error: internal error, {type(error).__name__}: {one_line(error)}; {produced}; hint: rerun with "
              "--debug for the traceback and report it", file=sys.stderr)
        raise SystemExit(EXIT_INTERNAL) from None
