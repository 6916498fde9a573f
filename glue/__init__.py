"""GLUE (paper section 5.3): byte-level BPE tokenizer, MLM pretraining of a small BERT
with any registered attention mechanism, and SST-2 / QQP / MNLI / QNLI fine-tuning, as
tasks of the one trainer (``glue.tasks``: ``glue_mlm``, ``glue_sst2`` ...).

Train with ``python scripts/train.py --config=configs/glue/{pretrain,finetune}.py:...``
(``python -m glue.pretrain`` / ``glue.finetune`` are aliases keeping the older flags);
prepare the data once with ``python -m glue.prepare``; the Table 4 report is
``scripts/glue_report.py``. See docs/glue.md.
"""
