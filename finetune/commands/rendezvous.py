"""`finetune rendezvous --nnodes N --node-rank R --main-addr HOST --main-port PORT`: every node of a multi-node launch
checks in before the launcher starts; a node that never arrives is named after `--timeout` seconds."""

from __future__ import annotations


def rendezvous_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "rendezvous", help="check that every node of a multi-node launch is up before starting it",
        description="Run on every node before `accelerate launch` (scripts/launch_multinode.sh does): the nodes meet "
        "at the main node's address and port; after --timeout seconds the missing node ranks are named.",
    )
    parser.add_argument("--nnodes", type=int, required=True, help="nodes in the job")
    parser.add_argument("--node-rank", type=int, required=True,
                        help="this node's rank (machine rank), 0 on the main node")
    parser.add_argument("--main-addr", required=True, help="address of node 0, reachable from every node")
    parser.add_argument("--main-port", type=int, required=True,
                        help="port on node 0 (the launcher's main process port)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every node (default 300)")
    parser.set_defaults(func=rendezvous_command)


def rendezvous_command(args) -> int:
    from finetune.launch.rendezvous import meet

    names = meet(args.main_addr, args.main_port, args.nnodes, args.node_rank, args.timeout)
    print(f"rendezvous: all {args.nnodes} nodes arrived at {args.main_addr}:{args.main_port} ({', '.join(names)})",
          flush=True)
    return 0
