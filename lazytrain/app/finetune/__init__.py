"""Fine-tuning a pretrained model on a dataset file (``lazytrain train --data``): ``run.py`` is the job,
``prepare.py`` the model, tokenizer and examples, ``evaluation.py`` exact match by generation."""

from ..config import FinetuneConfig
from .run import is_finetune_run, run

__all__ = ["FinetuneConfig", "is_finetune_run", "run"]
