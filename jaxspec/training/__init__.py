"""EAGLE-3 drafter training: data generation from the target, the draft vocabulary, training-time test, the trainer.

- `generate_dataset(target, prompts, out_dir, max_new_tokens=...)`: the target's own responses (resumable).
- `build_draft_vocab(token_ids, loss_mask, draft_vocab_size, vocab_size) -> (d2t, t2d)`.
- `train_drafter(target, dataset_dir, out_dir, TrainConfig(...)) -> Drafter` (or TrainConfig fields as keywords:
  `draft_vocab_size=..., steps=..., batch_size=...`); `TrainConfig` declares every training setting once.
"""

from jaxspec.training.data import Dataset, DatasetError, generate_dataset, load_dataset
from jaxspec.training.trainer import TrainConfig, train_drafter
from jaxspec.training.ttt import ttt_forward, ttt_logits
from jaxspec.training.vocab import build_draft_vocab

__all__ = [
    "Dataset",
    "DatasetError",
    "TrainConfig",
    "build_draft_vocab",
    "generate_dataset",
    "load_dataset",
    "train_drafter",
    "ttt_forward",
    "ttt_logits",
]
