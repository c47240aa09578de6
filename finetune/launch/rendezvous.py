"""A pre-flight meeting of the nodes of a multi-node launch, before any launcher starts: every node checks in at the
main node's address and port, and a node that does not arrive within the timeout is named, instead of the run
hanging in the launcher's rendezvous (torch's static rendezvous waits 600 s and then reports only a count).

It uses c10d's own `TCPStore` (the store torchrun's static rendezvous uses), on the main process port; the store is
closed again before `accelerate launch` binds the same port.
"""

from __future__ import annotations

import datetime
import socket
import time

from torch.distributed import TCPStore

from finetune.errors import RecipeError

POLL_SECONDS = 0.2


def _missing(store: TCPStore, num_nodes: int, prefix: str) -> list[int]:
    return [rank for rank in range(num_nodes) if not store.check([f"{prefix}/{rank}"])]


def meet(main_address: str, main_port: int, num_nodes: int, node_rank: int, timeout: float) -> list[str]:
    """Waits until every node of `num_nodes` has checked in; returns their hostnames in node-rank order.

    Raises `RecipeError` naming the node ranks that did not arrive (on the main node) or the unreachable main node
    (on the others) once `timeout` seconds have passed."""
    if not 0 <= node_rank < num_nodes:
        raise RecipeError(f"node rank {node_rank} is not in 0..{num_nodes - 1} (--nnodes {num_nodes}).")
    deadline = time.monotonic() + timeout
    where = f"{main_address}:{main_port}"
    try:
        store = TCPStore(main_address, main_port, is_master=node_rank == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as error:  # c10d raises DistNetworkError / DistStoreError, both RuntimeErrors
        if node_rank == 0:
            raise RecipeError(f"node 0 cannot listen on {where} ({str(error).splitlines()[0]}): is the port in use, "
                              f"or the address not one of this machine's?") from None
        raise RecipeError(
            f"node {node_rank} could not reach the main node (machine rank 0) at {where} within {timeout:g} s: start "
            f"the launch there too, and check that this machine can reach that address and port (firewall, "
            f"--interface).") from None
    store.set(f"arrived/{node_rank}", socket.gethostname())
    if node_rank == 0:
        while (missing := _missing(store, num_nodes, "arrived")) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        if missing:
            raise RecipeError(
                f"node(s) {', '.join(map(str, missing))} of {num_nodes} did not arrive at {where} within {timeout:g} "
                f"s: start the same launch on machine rank(s) {', '.join(map(str, missing))} with --main-addr "
                f"{main_address} --main-port {main_port}, and check that they can reach this address (firewall, "
                f"--interface).")
        store.set("all_arrived", "1")
    else:
        try:
            store.wait(["all_arrived"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        except RuntimeError:
            raise RecipeError(f"node {node_rank} reached {where}, but not every node arrived within {timeout:g} s; "
                              f"node 0 names the missing ones.") from None
    names = [store.get(f"arrived/{rank}").decode() for rank in range(num_nodes)]
    store.set(f"left/{node_rank}", "1")
    if node_rank == 0:  # keep the store up until every node has read the answer, then free the port for the launcher
        while _missing(store, num_nodes, "left") and time.monotonic() < deadline + timeout:
            time.sleep(POLL_SECONDS)
    return names
