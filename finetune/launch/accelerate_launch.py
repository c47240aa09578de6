"""`accelerate launch ARGS` as the toolkit runs it (`python -m finetune.launch.accelerate_launch ARGS`; printed as
`accelerate launch ARGS`): Accelerate's own launcher, in this process, whose ranks are its children.

Two differences:
- Ctrl-C or SIGTERM reaching the launcher ends it with the status a shell gives a process that signal ended (128 + its
  number), after torch's elastic agent has passed the signal to the ranks and they have said what to resume from
  (finetune.checkpoints.preemption), instead of the agent's `SignalException` traceback and status 1, and without the
  agent's lines about passing the signal on.
- A rank that failed ends the launcher with status 1 and the agent's closing summary (which quotes the rank's one-line
  error, finetune.cli), without the Python traceback of the launcher around it: the ranks have said what went wrong.
"""

from __future__ import annotations

import logging
import subprocess
import sys

# What torch's elastic agent logs (at WARNING) while it passes a signal to the ranks: (its logger, the message as
# logged). Its other warnings, a rank that will not stop and is killed among them, stay.
SIGNAL_RELAY_LINES = (
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal, shutting down workers"),
    ("torch.distributed.elastic.multiprocessing.api", "Sending process %s closing signal %s"),
)


class _Without(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name, message in SIGNAL_RELAY_LINES:
        logging.getLogger(name).addFilter(_Without(message))
    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:  # several processes: the agent's summary names each failed rank
        print(failed, file=sys.stderr, flush=True)
        return 1
    except subprocess.CalledProcessError as failed:  # one process, run as a plain child: it printed its own error
        return failed.returncode if failed.returncode > 0 else 128 - failed.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
