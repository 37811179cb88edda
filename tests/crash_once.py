"""A strategy script that kills its own rank once, for the fault test:

    torchrun --max_restarts=1 ... tests/crash_once.py ddp.py --out_dir=... --resume=latest ...

On the first attempt (TORCHELASTIC_RESTART_COUNT=0), the rank named by CRASH_RANK
SIGKILLs itself when it begins iteration CRASH_AT, after the checkpoints before it
were written; torchrun then restarts every rank, and --resume=latest continues."""
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model as M  # noqa: E402

begin_iter = M.begin_iter


def first_attempt():
    """TORCHELASTIC_RESTART_COUNT is each agent's own: on two nodes, the one whose ranks were
    restarted because the other's failed still says 0. There CRASH_MARK names a file that
    the first crash leaves behind."""
    mark = os.environ.get("CRASH_MARK")
    if not mark:
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.path.exists(mark):
        return False
    open(mark, "w").close()
    return True


def begin_or_die(run, it, evaluate):
    if (it == int(os.environ["CRASH_AT"]) and run.rank == int(os.environ.get("CRASH_RANK", "1"))
            and first_attempt()):
        os.kill(os.getpid(), signal.SIGKILL)
    return begin_iter(run, it, evaluate)


M.begin_iter = begin_or_die
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
