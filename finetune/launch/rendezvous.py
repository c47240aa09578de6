"""A pre-flight meeting of the nodes of a multi-node launch, before any launcher starts: every node checks in at the
main node's address and port, and a node that does not arrive within the timeout is named, instead of the run
hanging in the launcher's rendezvous (torch's static rendezvous waits 600 s and then reports only a count).

It uses c10d's own `TCPStore` (the store torchrun's static rendezvous uses), on the main process port; the store is
closed again before `accelerate launch` binds the same port.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import tempfile
import time

from torch.distributed import TCPStore

from finetune.errors import RecipeError
from finetune.launch.self_launch import check_port

POLL_SECONDS = 0.2


def _missing(store: TCPStore, num_nodes: int, prefix: str) -> list[int]:
    return [rank for rank in range(num_nodes) if not store.check([f"{prefix}/{rank}"])]


def meet(main_address: str, main_port: int, num_nodes: int, node_rank: int, timeout: float) -> list[str]:
    """Waits until every node of `num_nodes` has checked in; returns their hostnames in node-rank order.

    Raises `RecipeError` naming the node ranks that did not arrive (on the main node) or the unreachable main node
    (on the others) once `timeout` seconds have passed. c10d logs each retry with a C++ stack: that goes to a file,
    named in the error, not to the console."""
    if not 0 <= node_rank < num_nodes:
        raise RecipeError(f"node rank {node_rank} is not in 0..{num_nodes - 1} (--nnodes {num_nodes}).")
    check_port(main_port, "--main-port")
    check_address(main_address)
    with c10d_log_aside() as log:
        try:
            return _meet(main_address, main_port, num_nodes, node_rank, timeout)
        except RecipeError as error:
            kept = f" (c10d's log: {log})" if os.path.getsize(log) else ""
            raise RecipeError(f"{error}{kept}") from None


def check_address(address: str) -> None:
    """The main node's address resolves here (c10d would retry an unresolvable name until the timeout)."""
    try:
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError, TypeError, ValueError):
        raise RecipeError(f"`--main-addr {address!r}` is not an address this machine can resolve: give node 0's IP "
                          "address or host name, the same on every node.") from None


@contextlib.contextmanager
def c10d_log_aside():
    """Sends this process's stderr (file descriptor 2, where c10d's C++ logs) to a temporary file meanwhile; yields
    its path. The file is removed unless the block raised."""
    sys.stderr.flush()
    descriptor, path = tempfile.mkstemp(prefix="finetune-rendezvous-", suffix=".log")
    saved = os.dup(2)
    os.dup2(descriptor, 2)
    failed = False
    try:
        yield path
    except BaseException:
        failed = True
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(descriptor)
        if not failed or not os.path.getsize(path):
            os.unlink(path)


def _meet(main_address: str, main_port: int, num_nodes: int, node_rank: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    where = f"{main_address}:{main_port}"
    try:
        store = TCPStore(main_address, main_port, is_master=node_rank == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as error:  # c10d raises DistNetworkError / DistStoreError, both RuntimeErrors
        first_line = str(error).splitlines()[0]
        if node_rank == 0 and "listen" in first_line:
            raise RecipeError(f"node 0 cannot listen on port {main_port} ({first_line}): is the port in use? Give "
                              "another `--main-port`, the same on every node.") from None
        if node_rank == 0:  # listening, but its own client could not reach the address given
            raise RecipeError(f"node 0 listens on port {main_port} but could not reach itself at {where} within "
                              f"{timeout:g} s ({first_line}): `--main-addr` must be an address of this machine "
                              "that the other nodes reach too.") from None
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
