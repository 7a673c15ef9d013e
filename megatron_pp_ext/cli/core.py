"""The ``mppx`` command line: a registry of subcommands, the parser built from it, and
helpers shared by the commands.

A subcommand is two functions registered under a name::

    from megatron_pp_ext.cli import register_command

    def configure(parser):            # add flags to the subcommand's argparse parser
        parser.add_argument("--steps", type=int, default=10)

    def run(args) -> int:             # do the work; return the exit status (None means 0)
        ...

    register_command("train", "train a model with a pipeline schedule")(configure, run)

Nothing dispatches on names: :func:`main` builds one argparse sub-parser per registered
command. Built-in commands live in :mod:`megatron_pp_ext.cli.commands` (every module there
is imported), and other packages add commands through the ``mppx.commands`` entry-point
group (loading the entry point must register the command). Command modules import heavy
dependencies (torch, matplotlib) inside ``run`` so that ``mppx --help`` stays fast.

Errors: a :class:`CLIError` or a :class:`~megatron_pp_ext.schedule.ScheduleError` raised by a
command, or a bad flag, prints one line ``mppx: error: ...`` on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import pkgutil
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from ..clibase import CLIError, add_overlap_arguments, format_table, int_at_least, name_list  # noqa: F401 - the CLI's own names
from ..schedule import ScheduleError

PROG = "mppx"
ENTRY_POINT_GROUP = "mppx.commands"


class _Exit(Exception):
    """argparse asked to exit (``--help``, or an error already turned into a message)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    description: str | None = None
    order: int = 100


_COMMANDS: dict[str, Command] = {}


def register_command(name: str, help: str, *, description: str | None = None, order: int = 100,
                     replace: bool = False) -> Callable[..., Command]:
    """``register_command(name, help)(configure, run)`` adds the subcommand ``mppx NAME``.

    ``configure(parser)`` adds its flags; ``run(args)`` returns the exit status (None: 0).
    ``order`` sorts the commands in ``mppx --help`` (built-ins use 10..50).
    """
    def registrar(configure: Callable[[argparse.ArgumentParser], None],
                  run: Callable[[argparse.Namespace], int | None]) -> Command:
        if name in _COMMANDS and not replace and _COMMANDS[name].run is not run:
            raise ValueError(f"mppx command {name!r} is already registered")
        cmd = Command(name, help, configure, run, description, order)
        _COMMANDS[name] = cmd
        return cmd
    return registrar


def registered_commands() -> dict[str, Command]:
    """The registered commands (built-ins and plugins loaded), in help order."""
    load_commands()
    return dict(sorted(_COMMANDS.items(), key=lambda kv: (kv[1].order, kv[0])))


_LOADED = False


def load_commands() -> None:
    """Import the built-in command modules and the ``mppx.commands`` entry points (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    pkg = importlib.import_module(f"{__package__}.commands")

    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
    try:
        from importlib.metadata import entry_points

        eps = entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - broken metadata must not break the CLI
        eps = ()
    for ep in eps:
        try:
            ep.load()
        except Exception as e:  # a broken plugin must not break the other commands
            print(f"{PROG}: warning: could not load command plugin {ep.name!r}: {e}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise CLIError(f"{message} (see '{self.prog} --help')")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message, file=sys.stderr, end="")
        raise _Exit(status)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Zero-bubble and controllable-memory pipeline schedules for Megatron-Core: "
                    "list, simulate, compare, draw and export them.",
        epilog=f"'{PROG} COMMAND --help' shows the flags of a command; docs/cli.md has examples.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="_command", metavar="COMMAND", title="commands")
    for cmd in registered_commands().values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _one_line(message: str) -> str:
    parts = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    return "; ".join(parts) or "failed"


def error(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mppx`` with ``argv`` (default: sys.argv[1:]); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        run = getattr(args, "_run", None)
        if run is None:
            return error(f"choose a command: {', '.join(registered_commands())} (see '{PROG} --help')")
        status = run(args)
        return 0 if status is None else int(status)
    except _Exit as e:
        return e.status
    except (CLIError, ScheduleError) as e:
        return error(str(e))
    except BrokenPipeError:  # e.g. `mppx schedules | head -1`
        _drop_stdout()
        return 0
    except OSError as e:  # e.g. `mppx compare --json > /dev/full`: the output cannot be written
        if e.errno not in (errno.ENOSPC, errno.EIO, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG):
            raise
        _drop_stdout()
        return error(f"writing the output failed ({e.strerror or e}); free some space or write it elsewhere")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _drop_stdout() -> None:
    """Standard output failed: send what is left of it nowhere (not a second error at exit)."""
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass


# --- flag types and helpers shared by the commands -------------------------------------

def parse_costs(spec: str | None) -> tuple[float, float, float, float]:
    """``--costs F,B,W[,COMM]`` (:func:`megatron_pp_ext.schedule.costs.parse_costs`), as a CLIError."""
    from ..schedule.costs import parse_costs as parse
    try:
        return parse(spec)
    except ScheduleError as e:
        raise CLIError(str(e)) from None


_BYTE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
               "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str) -> float:
    """``2GiB``, ``512MB``, ``1.5e9`` -> bytes."""
    t = text.strip().lower().replace(" ", "")
    i = len(t)
    while i and t[i - 1].isalpha():
        i -= 1
    num, unit = t[:i], t[i:]
    try:
        value = float(num) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise CLIError(f"{flag} {text!r}: give a size such as 2GiB, 512MB or 1.5e9 (bytes)") from None
    if not math.isfinite(value) or value < 1:
        raise CLIError(f"{flag} {text!r}: must be a finite size of at least 1 byte, e.g. 2GiB")
    return value


def add_config_arguments(parser: argparse.ArgumentParser, *, microbatches: int = 16,
                         chunks: int | None = None) -> None:
    """--pp, --microbatches, --chunks, --costs, --memory-budget (shared by every schedule command)."""
    parser.add_argument("--pp", type=int_at_least(1, 4), default=4, metavar="P",
                        help="pipeline-parallel ranks (default: 4)")
    parser.add_argument("--microbatches", type=int_at_least(1, 8), default=microbatches, metavar="M",
                        help=f"microbatches per iteration (default: {microbatches})")
    parser.add_argument("--chunks", type=int_at_least(1, 2), default=chunks, metavar="V",
                        help="model chunks per rank, for schedules that take a chunk count such as "
                             "interleaved-1f1b (the V schedules always use 2)"
                             + (f" (default: {chunks})" if chunks else ""))
    parser.add_argument("--costs", default="1,1,1,0", metavar="F,B,W[,COMM]",
                        help="per-rank times of a forward, an input backward, a weight backward and the "
                             "p2p latency (default: 1,1,1,0)")
    parser.add_argument("--memory-budget", default=None, metavar="X",
                        help="activation memory per rank, in units (e.g. 3) or as a fraction of 1F1B's "
                             "peak (e.g. 0.5x or 50%%); for schedules that take a budget (v-budget)")
    add_overlap_arguments(parser)


def add_comm_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--comm-model``: which communication model the figures assume (schedule/commmodel.py)."""
    from ..schedule.commmodel import comm_model_names
    parser.add_argument("--comm-model", default="eager", choices=comm_model_names(), metavar="MODEL",
                        help="how the send/recv ops run: eager (any transfer once both sides are posted), nccl "
                             "(what the executor runs on GPUs: one NCCL communicator per channel), "
                             "nccl-batched (Megatron-Core's batch_isend_irecv, waited for at the batch end), "
                             "nccl-batched-consumer, nccl-batched-sync, nccl-pairwise, nccl-channels, blocking; "
                             "anything but eager inserts the send/recv ops (default: eager)")


def comm_model_of(args: argparse.Namespace) -> str:
    return getattr(args, "comm_model", None) or "eager"


def deadlock_reason(model: str, error) -> str:
    """A few words for a schedule that deadlocks under ``--comm-model``: where it first waits."""
    return f"deadlocks under --comm-model {model} ({error.brief()})"


def simulate_under_model(schedule, cost, args: argparse.Namespace):
    """``simulate`` under the ``--comm-model`` asked; a schedule that cannot run there is a
    one-line CLIError naming the flag (what a schedule the executor builds does under that NCCL
    strategy: the executor would refuse it before its first op)."""
    from ..schedule import simulate
    from ..schedule.simresult import DeadlockError
    model = comm_model_of(args)
    try:
        return simulate(schedule, cost, comm_model=model)
    except DeadlockError as e:
        if model == "eager":
            raise
        raise CLIError(f"schedule {schedule.name!r} {deadlock_reason(model, e)}; pick another "
                       "--comm-model (nccl: what the executor runs on GPUs)") from None


def add_schedule_arguments(parser: argparse.ArgumentParser, *, microbatches: int = 16,
                           with_comm: bool = True) -> None:
    parser.add_argument("--schedule", required=True, metavar="NAME",
                        help="schedule name (see 'mppx schedules')")
    add_config_arguments(parser, microbatches=microbatches)
    if with_comm:
        parser.add_argument("--with-comm", action="store_true",
                            help="insert explicit send/recv ops (blocking batches, as a runtime issues them)")


def build_from_args(args: argparse.Namespace, name: str | None = None, *, chunks: int | None = None,
                    memory_budget=None, with_comm: bool | None = None):
    """Build (schedule, cost) for ``args`` (or the overrides); errors name the flag."""
    from ..schedule import build_schedule, schedule_info

    name = name or args.schedule
    info = schedule_info(name)
    costs = parse_costs(args.costs)
    if chunks is None:  # --chunks if given (build_schedule refuses a wrong one), else the schedule's own
        chunks = args.chunks or info.chunks or 1
    if memory_budget is None:
        memory_budget = args.memory_budget
    if with_comm is None:
        with_comm = bool(getattr(args, "with_comm", False)) or comm_model_of(args) != "eager"
    overlap = {"overlap": bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
               "a2a_time": getattr(args, "a2a_time", None)}
    try:
        return build_schedule(name, args.pp, args.microbatches, chunks=chunks, costs=costs,
                              memory_budget=memory_budget, with_comm=with_comm, **overlap)
    except ScheduleError as e:
        if chunks > 1 and info.chunks is None and not _chunks_message(e):
            try:  # does it work with one chunk? then --chunks is what is wrong
                build_schedule(name, args.pp, args.microbatches, chunks=1, costs=costs,
                               memory_budget=memory_budget, with_comm=False)
            except ScheduleError:
                raise e from None
            raise CLIError(f"--chunks {chunks}: schedule {name!r} runs one model chunk per rank; drop --chunks "
                           "(interleaved and V schedules use several)") from None
        raise


def _chunks_message(e: Exception) -> bool:
    return "--chunks" in str(e)


def simulator_json(obj):
    """``obj`` with every float at 8 significant digits, inside the simulator's resolution: its sums of
    rounded times leave noise past it (a makespan of 26.933333311, a peak of 4.999999995 units where
    1F1B's reads 5.0); an input such as a COMM of 1e-12 keeps its value, and byte counts (keys
    with "bytes") stay exact."""
    if isinstance(obj, float):
        return float(f"{obj:.8g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: v if "bytes" in str(k) else simulator_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [simulator_json(v) for v in obj]
    return obj


def is_stdout(path: str) -> bool:
    """'-' or a name of standard output (/dev/stdout, /dev/fd/1, /proc/self/fd/1)."""
    if path == "-":
        return True
    try:
        return os.path.exists(path) and os.path.samefile(path, "/dev/stdout")
    except OSError:
        return False


def check_writable(path: str, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work is spent on what goes in it
    (a file that did not exist is removed again)."""
    if is_stdout(path):
        return
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot write ({e.strerror or e}); give a writable file path") from None
    if not existed:
        os.remove(path)


def write_text(path: str, text: str, flag: str = "-o") -> None:
    """Write ``text`` to ``path`` ('-' = stdout); an OSError becomes a CLIError naming the flag."""
    if path == "-":
        sys.stdout.write(text)
        if not text.endswith("\n"):
            sys.stdout.write("\n")
        return
    try:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot write ({e.strerror or e}); give a writable file path") from None


