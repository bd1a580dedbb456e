"""The ranks of a torchrun launch: joining the process group, control messages, liveness, a failed rank named.

    if launched():                       # torchrun set WORLD_SIZE > 1 (outside torchrun nothing here runs)
        ranks = Ranks.join(config)       # the process group (gloo on CPU, NCCL on CUDA) + a gloo control group
        ranks.send_control(1, {...})     # rank 0 -> a worker: a JSON message (nothing is unpickled)
        msg = ranks.recv_control(0)
        ranks.failure("waiting for rank 2's logits", err)   # a RankError naming the rank that stopped

Every rank runs the same command and YAML; rank 0 drives the others. The process group and the control
group carry `distributed.timeout_s`: a rank that does not answer within it ends the waiting rank's call.
Every rank beats a counter in the rendezvous store (`offload/alive/<rank>`) twice a second, and a rank
that fails writes why (`offload/failed/<rank>`); when a pass fails, the counters that stopped moving name
the rank that died or hung. Nothing here binds a socket: torch.distributed listens where the rendezvous
(MASTER_ADDR / --rdzv-endpoint) says (a loopback rendezvous keeps gloo on the loopback interface). This
module knows ranks and messages, not models or passes.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist

from offload.config import OffloadConfig
from storage.errors import OffloadError

log = logging.getLogger(__name__)

#: seconds between liveness beats; a counter unchanged over STALE_BEATS beats names a dead or hung rank
BEAT_S = 0.5
STALE_BEATS = 5


class RankError(OffloadError):
    """A rank of a distributed run died, hung, or failed: every rank stops."""


def launched() -> bool:
    """Is this process one rank of several (torchrun, or any launcher setting WORLD_SIZE > 1)?"""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def bind_where_the_rendezvous_says() -> None:
    """A rendezvous on a loopback address (a one-machine launch, the tests) keeps gloo's sockets on the
    loopback interface too, whatever this host's name resolves to (GLOO_SOCKET_IFNAME, if set, decides)."""
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return
    if loopback:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and ipaddress.ip_address(a.address).is_loopback for a in addrs):
                os.environ["GLOO_SOCKET_IFNAME"] = name
                return


def backend_for(config: OffloadConfig, device: torch.device) -> str:
    b = config.distributed.backend
    return ("nccl" if device.type == "cuda" else "gloo") if b == "auto" else b


def rank_device(config: OffloadConfig) -> OffloadConfig:
    """`device: cuda` (or auto on a CUDA machine) means this rank's own GPU, cuda:LOCAL_RANK."""
    dev = config.device
    if dev == "cuda" or (dev == "auto" and torch.cuda.is_available()):
        return config.replace(device=f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return config


@dataclass
class Ranks:
    rank: int
    world: int
    backend: str
    timeout_s: float
    control: Any  # the gloo group control messages travel in (the data group may be NCCL)
    store: Any  # the rendezvous store: liveness counters and failure notes
    _stop: threading.Event = field(default_factory=threading.Event)
    _beat: threading.Thread | None = None
    resident: bool = False  # no rank streams weights (agreed when the stages are planned)
    lock: threading.Lock = field(default_factory=threading.Lock)  # rank 0: one control message at a time
    sent: float = 0.0  # rank 0: when it last sent the workers a message (monotonic)
    failed: RankError | None = None  # rank 0: what the keep-alive thread met

    @classmethod
    def join(cls, config: OffloadConfig, device: torch.device) -> Ranks:
        """This process's rank in the launch (the process group initialised on first use)."""
        timeout = datetime.timedelta(seconds=config.distributed.timeout_s)
        backend = backend_for(config, device)
        if not dist.is_initialized():
            bind_where_the_rendezvous_says()
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        store = dist.PrefixStore("offload/", dist.distributed_c10d._get_default_store())
        ranks = cls(dist.get_rank(), dist.get_world_size(), backend, config.distributed.timeout_s, control, store)
        ranks._beat = threading.Thread(target=ranks._beating, name=f"offload-alive-{ranks.rank}", daemon=True)
        ranks._beat.start()
        return ranks

    # -- liveness -------------------------------------------------------------------------------
    def _beating(self) -> None:
        n = 0
        while not self._stop.wait(BEAT_S):
            n += 1
            try:
                self.store.set(f"alive/{self.rank}", str(n))
            except Exception:  # the store's host is gone: the passes will say so
                return

    def _beats(self) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for r in range(self.world):
            try:
                out[r] = self.store.get(f"alive/{r}").decode() if self.store.check([f"alive/{r}"]) else None
            except Exception:
                out[r] = None
        return out

    def note_failure(self, why: str) -> None:
        """Tell the other ranks why this one stops (best effort)."""
        try:
            self.store.set(f"failed/{self.rank}", why[:500])
        except Exception:
            pass

    def failure(self, doing: str, err: BaseException, peer: int) -> RankError:
        """The error for a failed wait: the ranks whose beat stopped, else those that said they failed, else
        the peer waited on."""
        self.note_failure(f"{doing}: {err}")  # at once: the rank that waits on this one reads why, not silence
        first = self._beats()
        time.sleep(BEAT_S * STALE_BEATS)
        second = self._beats()
        notes = {}
        for r in range(self.world):
            try:
                if r != self.rank and self.store.check([f"failed/{r}"]):
                    notes[r] = self.store.get(f"failed/{r}").decode()
            except Exception:
                pass
        stopped = [r for r in range(self.world) if r != self.rank and first[r] == second[r] and r not in notes]
        if stopped:
            who = ", ".join(f"rank {r}" for r in stopped)
            why = f"{who} stopped answering (died or hung)"
        elif notes:
            who = ", ".join(f"rank {r}" for r in notes)
            why = "; ".join(f"rank {r} failed: {n}" for r, n in notes.items())
        else:
            who, why = f"rank {peer}", f"rank {peer} did not answer within {self.timeout_s:g}s ({err})"
        msg = f"rank {self.rank}, {doing}: {why}; every rank stops (restart the job once {who} is back)"
        self.note_failure(msg)
        return RankError(msg)

    def keep_alive(self) -> None:
        """Rank 0, from when its stage is planned: a message to every worker whenever a quarter of the timeout
        passed without one (loading, an idle server), so that a worker's wait ends only if rank 0 is gone."""
        self.sent = time.monotonic()
        threading.Thread(target=self._keeping, name="offload-keepalive", daemon=True).start()

    def _keeping(self) -> None:
        every = max(self.timeout_s / 4, 0.25)
        while not self._stop.wait(min(every / 4, 1.0)):
            if time.monotonic() - self.sent < every or not self.lock.acquire(blocking=False):
                continue
            try:
                for w in range(1, self.world):
                    self.send_control(w, {"kind": "ping", "ops": []})
                self.sent = time.monotonic()
            except Exception as e:
                self.failed = self.failure("keeping the workers company", e, w)
                return
            finally:
                self.lock.release()

    # -- control messages (JSON over the gloo control group) -------------------------------------
    def send_control(self, dst: int, msg: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(msg).encode()), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=self.control)
        dist.send(data, dst, group=self.control)

    def recv_control(self, src: int) -> dict:
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, src, group=self.control)
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.control)
        return json.loads(data.numpy().tobytes().decode())

    def agree_min(self, values: list[int]) -> list[int]:
        """Each value's minimum over every rank."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return t.tolist()

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values`, in rank order."""
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.control)
        return [t.tolist() for t in out]

    def close(self) -> None:
        with self.lock:  # not in the middle of a keep-alive message
            self._stop.set()
        if dist.is_initialized():
            dist.destroy_process_group()
