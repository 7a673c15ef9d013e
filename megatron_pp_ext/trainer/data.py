"""Microbatches for ``mppx train`` from Megatron-Core's GPT datasets.

* default: Megatron-Core's **MockGPTDataset** built through ``BlendedMegatronDatasetBuilder``
  with a ``GPTDatasetConfig`` — the same sample/shuffle indices (``helpers_cpp``) and the same
  mock documents (``(1, 2, 3, ...) % vocab`` followed by the end-of-document token) as
  Megatron-LM's ``--mock-data``. Its low-level document pool is made smaller (enough documents
  for the run, of up to ``2 x seq`` tokens, instead of 100,000 documents of up to 4,096
  tokens) so that building the indices takes milliseconds, not seconds per rank;
* ``--data-path PREFIX``: a tokenized corpus, Megatron's indexed dataset ``PREFIX.bin`` /
  ``PREFIX.idx`` (e.g. from Megatron-LM's ``tools/preprocess_data.py``), through ``GPTDataset``;
* fallback (reported in the log): when the installed Megatron-Core cannot build the mock
  dataset, the deterministic synthetic batches of :func:`megatron_pp_ext.runtime.setup.make_batch`.

The dataset configuration needs a tokenizer only for its special tokens and vocabulary size:
:class:`TinyTokenizer` provides those (``eod = vocab - 1``, no pad token), so no tokenizer
files are needed.

Sample ``(it * G + g) * b + j`` (G microbatches per iteration over all data-parallel ranks, b
sequences per microbatch) is sequence ``j`` of global microbatch ``g`` of iteration ``it``;
data-parallel rank ``d`` runs the global microbatches ``d*m .. d*m+m-1``. A pp=1 run on one
process with ``G`` microbatches therefore sees exactly the same sequences as any layout.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch

__all__ = ["TinyTokenizer", "DataSource", "build_data", "corpus_tokens"]


class TinyTokenizer:
    """What ``GPTDatasetConfig`` needs of a tokenizer: vocabulary size, end-of-document token and
    identifiers for the index cache. No pad token (the dataset then uses its own)."""

    def __init__(self, vocab_size: int, eod: int | None = None):
        self.vocab_size = int(vocab_size)
        self.eod = int(vocab_size - 1 if eod is None else eod)
        self.unique_identifiers = collections.OrderedDict(
            [("class", "mppx.TinyTokenizer"), ("vocab_size", self.vocab_size), ("eod", self.eod)])

    @property
    def eos(self) -> int:
        return self.eod


class _Quiet:
    """Silence the dataset builder's INFO/WARNING chatter (e.g. 'Unable to save ... indexes
    because path_to_cache is None') while it builds."""

    def __enter__(self):
        self.logger = logging.getLogger("megatron.core.datasets")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _mock_dataset_class(num_docs: int, max_doc_len: int):
    from megatron.core.datasets.gpt_dataset import MockGPTDataset, MockGPTLowLevelDataset

    class SmallMockGPTLowLevelDataset(MockGPTLowLevelDataset):
        size = num_docs
        max_sequence_length = max_doc_len

    class SmallMockGPTDataset(MockGPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return SmallMockGPTLowLevelDataset(config.tokenizer)

    return SmallMockGPTDataset


class DataSource:
    """Microbatches of one run (every rank builds the same one)."""

    def __init__(self, dataset: Any, kind: str, *, seq: int, micro_batch_size: int, global_microbatches: int,
                 vocab: int, seed: int, device: torch.device | str = "cpu", note: str = ""):
        self.dataset = dataset
        self.kind = kind                 # "mock", "indexed" or "synthetic"
        self.seq = seq
        self.mbs = micro_batch_size
        self.G = global_microbatches
        self.vocab = vocab
        self.seed = seed
        self.device = torch.device(device)
        self.note = note

    @property
    def description(self) -> str:
        return {"mock": "Megatron-Core MockGPTDataset (BlendedMegatronDatasetBuilder, GPTDatasetConfig)",
                "indexed": "Megatron indexed dataset (GPTDataset)",
                "synthetic": "deterministic synthetic tokens (runtime.setup.make_batch)"}[self.kind] + (
            f"; {self.note}" if self.note else "")

    def microbatch(self, iteration: int, g: int) -> dict:
        """Global microbatch ``g`` of iteration ``iteration`` (0-based), on the device."""
        if self.kind == "synthetic":
            from ..runtime.setup import make_batch
            batch = make_batch(self.seed, iteration, g, self.mbs, self.seq, self.vocab)
        else:
            base = (iteration * self.G + g) * self.mbs
            samples = [self.dataset[base + j] for j in range(self.mbs)]
            batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                     for k in ("tokens", "labels", "loss_mask", "position_ids")}
            top = int(max(batch["tokens"].max(), batch["labels"].max()))
            if top >= self.vocab:
                raise ValueError(f"token id {top} in the data is outside the vocabulary (--vocab {self.vocab}); "
                                 f"set --vocab to at least {top + 1} (the tokenizer's vocabulary size)")
            batch["loss_mask"] = batch["loss_mask"].float()
        if self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch

    def microbatches(self, iteration: int, first: int, count: int) -> list[dict]:
        return [self.microbatch(iteration, first + i) for i in range(count)]


def corpus_tokens(prefix: str) -> int:
    """Tokens in the indexed dataset ``prefix`` (.bin/.idx)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix)  # (keep it alive: its arrays are views of its memory map)
    total = int(ds.sequence_lengths.sum())
    del ds
    return total


def build_data(plan, *, device: torch.device | str = "cpu") -> DataSource:
    """The run's data source. Distributed-aware (Megatron's builder synchronises the ranks):
    call it on every rank of the process group."""
    c = plan.cfg
    num_samples = c.iters * plan.global_microbatches * c.micro_batch_size
    common = dict(seq=c.seq, micro_batch_size=c.micro_batch_size, global_microbatches=plan.global_microbatches,
                  vocab=c.vocab, seed=c.seed, device=device)
    try:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    except ImportError as e:  # pragma: no cover - megatron-core without datasets
        if plan.data != "mock":
            raise
        return DataSource(None, "synthetic", note=f"Megatron-Core datasets unavailable: {e}", **common)

    kw: dict[str, Any] = dict(random_seed=c.seed, sequence_length=c.seq, tokenizer=TinyTokenizer(c.vocab),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              split="100,0,0")
    try:
        GPTDatasetConfig(create_attention_mask=False, **dict(kw, split="100,0,0"))
        kw["create_attention_mask"] = False
    except TypeError:  # older releases have no such field
        pass
    sizes = [num_samples, None, None]
    if plan.data == "mock":
        try:
            # enough documents for the run (mean length ~ seq), plus some to shuffle
            docs = 2 * num_samples * (c.seq + 1) // max(1, c.seq) + 64
            cls = _mock_dataset_class(docs, max(2, 2 * c.seq))
            with _Quiet():
                datasets = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, GPTDatasetConfig(**kw)).build()
            return DataSource(datasets[0], "mock", **common)
        except Exception as e:  # noqa: BLE001 - report and fall back to deterministic data
            return DataSource(None, "synthetic", note=f"MockGPTDataset could not be built here "
                                                      f"({type(e).__name__}: {e})", **common)
    kw["blend"] = ([plan.data], None)
    with _Quiet():
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, GPTDatasetConfig(**kw)).build()
    ds = datasets[0]
    if ds is None or len(ds) < num_samples:
        raise ValueError(f"--data-path {plan.data}: the corpus gives {0 if ds is None else len(ds)} sequences of "
                         f"--seq {c.seq}, but the run needs {num_samples}")
    return DataSource(ds, "indexed", **common)
