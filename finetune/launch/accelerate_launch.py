"""`accelerate launch ARGS` as the toolkit runs it (`python -m finetune.launch.accelerate_launch ARGS`; printed as
`accelerate launch ARGS`): Accelerate's own launcher, in this process, whose ranks are its children.

One difference: Ctrl-C or SIGTERM reaching the launcher ends it with the status a shell gives a process that signal
ended (128 + its number), after torch's elastic agent has passed the signal to the ranks and they have said what to
resume from (finetune.checkpoints.preemption), instead of the agent's `SignalException` traceback and status 1.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException

    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
