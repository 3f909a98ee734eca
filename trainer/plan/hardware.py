"""The hardware a layout search times its candidates on: one device's memory and FLOP/s, and
the two links a collective can run over (inside an NVLink domain, or across domains).

The figures are the cluster preset's (conf/cluster/*.yaml names their sources). A collective
is costed like NCCL's ring algorithms, by the bytes one rank sends and the hops it waits for
(alpha-beta): an all-gather or reduce-scatter of a tensor of X bytes over n ranks sends
(n-1)/n x X and takes n-1 hops; an all-reduce twice that; an all-to-all (n-1)/n x X in n-1
hops; a point-to-point send X in one.

Ranks that share CPU cores (cluster.cpu_cores_per_node, fewer than procs_per_node) differ in
two ways the cost model asks of shares_cores and bubble_share: the cores that compute also move
the messages, so overlap hides nothing; and a rank waiting in a pipeline's bubble hands its
core to the ranks still computing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel.layout import Layout
from trainer.config import Precision
from trainer.units import GiB


@dataclass(frozen=True)
class Link:
    name: str  # "NVLink" or "network"
    bandwidth: float  # bytes/s one rank sends
    latency: float  # seconds a hop

    def ring(self, n: int, total_bytes: float) -> float:
        """An all-gather or reduce-scatter whose full tensor is total_bytes."""
        if n == 1:
            return 0.0
        return (n - 1) / n * total_bytes / self.bandwidth + (n - 1) * self.latency

    def all_reduce(self, n: int, total_bytes: float) -> float:
        return 2 * self.ring(n, total_bytes)

    def all_to_all(self, n: int, total_bytes: float) -> float:
        return self.ring(n, total_bytes)

    def send(self, nbytes: float) -> float:
        return nbytes / self.bandwidth + self.latency


@dataclass(frozen=True)
class Hardware:
    device_memory_gib: float
    memory_margin: float
    peak_bf16_tflops: float
    peak_fp32_tflops: float
    compute_efficiency: float
    nvlink_bandwidth_gbs: float
    network_bandwidth_gbs: float
    link_latency_us: float
    gpus_per_nvlink_domain: int
    ranks_per_core: float = 1.0  # > 1: the ranks of a node take turns on its CPU cores

    @classmethod
    def from_cluster(cls, cluster: Any) -> Hardware:
        """From the cluster config node (DictConfig or dataclass)."""
        cores = cluster.cpu_cores_per_node
        share = max(1.0, cluster.procs_per_node / cores) if cores else 1.0
        names = [name for name in cls.__dataclass_fields__ if name != "ranks_per_core"]
        return cls(*(getattr(cluster, name) for name in names), ranks_per_core=share)

    @property
    def shares_cores(self) -> bool:
        return self.ranks_per_core > 1

    def bubble_share(self, pp: int) -> float:
        """The share of a pipeline bubble's time the step loses. A device per rank: all of it.
        k ranks a core: at the bubble's deepest 1/pp of the ranks compute, and they keep every
        core busy once k >= pp; between, the loss falls linearly from 1 at k = 1 to 0 at
        k = pp (an interpolation, checked by bench/auto.py's ranking on gloo ranks)."""
        if pp == 1:
            return 0.0
        return max(0.0, (pp - self.ranks_per_core) / (pp - 1))

    @property
    def budget_bytes(self) -> int:
        """What a rank's planned peak may reach: the device less the margin."""
        return int(self.device_memory_gib * GiB * (1 - self.memory_margin))

    def peak_flops(self, precision: Precision) -> float:
        """A device's peak FLOP/s in the precision's matrix products (what MFU divides by)."""
        peak = self.peak_bf16_tflops if precision is Precision.bf16 else self.peak_fp32_tflops
        return peak * 1e12

    def flops(self, precision: Precision) -> float:
        """FLOP/s a rank achieves in the model's GEMMs and attention."""
        return self.peak_flops(precision) * self.compute_efficiency

    def link(self, layout: Layout, group: str) -> Link:
        """The link one group of this kind communicates over: NVLink when it fits in a domain
        (the slowest hop of a ring decides its time)."""
        latency = self.link_latency_us * 1e-6
        if layout.group_span(group) <= self.gpus_per_nvlink_domain:
            return Link("NVLink", self.nvlink_bandwidth_gbs * 1e9, latency)
        return Link("network", self.network_bandwidth_gbs * 1e9, latency)
