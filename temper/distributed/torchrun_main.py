"""torchrun (`torch.distributed.run`) as `temper ... --nproc N` starts it, quiet when stopped.

`run_under_torchrun` passes a Ctrl-C on to torchrun as SIGTERM. torchrun then stops its ranks
and raises its `SignalException`, which plain `python -m torch.distributed.run` prints as a
30-line traceback just before Temper's own one-line message (how to resume). Here that
exception ends the launcher with the signal's exit code (128 + signal number) instead; any
other error is reported by torchrun as usual.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as stopped:
        sys.exit(128 + int(stopped.sigval))
