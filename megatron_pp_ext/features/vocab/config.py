"""Vocabulary-parallel settings and the vocabulary partition (torch-free).

:class:`VocabParallelConfig` is what the flags mean (:mod:`.flags`); :class:`VocabPartition`
says which rows of the (padded) vocabulary one shard owns. Both are plain Python so the
schedule pass, the cost models and the CLI can use them without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...schedule.ir import ScheduleError

__all__ = ["VocabParallelConfig", "VocabPartition", "VocabConfigError", "ALGORITHMS"]

ALGORITHMS = (1, 2)


class VocabConfigError(ScheduleError):
    """A bad vocabulary-parallel setting or combination; the message names the flag and the fix."""


@dataclass(frozen=True)
class VocabParallelConfig:
    """Resolved vocabulary-parallel settings.

    algorithm: 1 (two reduction barriers per microbatch: after the S pass and after the T
        pass; the last stage keeps p+2 microbatches in flight) or 2 (one barrier: the S pass
        also computes A_i = softmax_i W_i and B_i = W_i[target], so the input gradient comes out
        of the first reduction; p+1 in flight).
    label_smoothing: as Megatron's cross entropy (0 = off).
    input_embedding: also split the input embedding over the ranks (partial lookups summed
        into the first stage, gradient broadcast back).
    extra_inflight: microbatches each rank may run ahead of its schedule while the vocabulary
        barriers complete (None: 2 for Algorithm 1, 1 for Algorithm 2, as in the paper).
    one_queue: place the passes so that the main thread can issue every collective at a point
        of the schedule that cannot hang under one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``;
        :mod:`.one_queue`): Algorithm 2's input-gradient all-reduce is posted at each rank's T, so
        the loss backward waits for every rank's T as under Algorithm 1.
    one_queue_comms: with ``one_queue``, the communicators each channel rotates over (microbatch
        m on m mod this): how many collectives of a channel a rank may have in flight.
    """

    algorithm: int = 2
    label_smoothing: float = 0.0
    input_embedding: bool = True
    extra_inflight: int | None = None
    one_queue: bool = False
    one_queue_comms: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise VocabConfigError(f"--vocab-parallel-algorithm {self.algorithm!r}: choose 1 (two barriers, "
                                   "the reference's --disable-backward-fusion) or 2 (one barrier)")
        if not 0.0 <= float(self.label_smoothing) < 1.0:
            raise VocabConfigError(f"--vocab-parallel-label-smoothing {self.label_smoothing!r}: must be in [0, 1), "
                                   "e.g. 0.1 (0: none)")
        if int(self.one_queue_comms) < 1:
            raise VocabConfigError(f"--vocab-parallel-one-queue-comms {self.one_queue_comms!r}: must be >= 1 "
                                   "(communicators per channel), e.g. 2")
        if self.extra_inflight is not None and self.extra_inflight < 0:
            raise VocabConfigError(f"extra_inflight {self.extra_inflight!r} must be >= 0")

    @property
    def barriers(self) -> int:
        return 2 if self.algorithm == 1 else 1

    @property
    def inflight(self) -> int:
        """Extra microbatches a rank may hold while waiting for the barriers."""
        if self.extra_inflight is not None:
            return self.extra_inflight
        return 2 if self.algorithm == 1 else 1

    def to_dict(self) -> dict:
        d = {"algorithm": self.algorithm, "label_smoothing": self.label_smoothing,
             "input_embedding": self.input_embedding, "extra_inflight": self.inflight}
        if self.one_queue:
            d["one_queue"] = True
            d["one_queue_comms"] = self.one_queue_comms
        return d


@dataclass(frozen=True)
class VocabPartition:
    """Shard ``shard`` of ``num_shards`` of a vocabulary of ``vocab_size`` entries.

    The vocabulary is padded to a multiple of ``num_shards`` (``padded_size``); every shard owns
    ``rows`` consecutive rows ``[start, stop)``. Rows at or beyond ``vocab_size`` are padding:
    they are never looked up and their logits are excluded from the softmax, so the sharded
    model computes exactly what the unpadded one does. ``valid_rows`` counts the real rows.
    """

    vocab_size: int
    num_shards: int
    shard: int

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise VocabConfigError(f"vocabulary size {self.vocab_size} must be >= 1")
        if self.num_shards < 1:
            raise VocabConfigError(f"number of vocabulary shards {self.num_shards} must be >= 1")
        if not 0 <= self.shard < self.num_shards:
            raise VocabConfigError(f"shard {self.shard} is outside 0..{self.num_shards - 1}")

    @property
    def padded_size(self) -> int:
        return -(-self.vocab_size // self.num_shards) * self.num_shards

    @property
    def rows(self) -> int:
        return self.padded_size // self.num_shards

    @property
    def start(self) -> int:
        return self.shard * self.rows

    @property
    def stop(self) -> int:
        return self.start + self.rows

    @property
    def valid_rows(self) -> int:
        return max(0, min(self.stop, self.vocab_size) - self.start)

    def of(self, shard: int) -> "VocabPartition":
        return VocabPartition(self.vocab_size, self.num_shards, shard)

    def to_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "padded_size": self.padded_size, "num_shards": self.num_shards,
                "shard": self.shard, "start": self.start, "stop": self.stop, "valid_rows": self.valid_rows}
