"""GLUE (paper section 5.3): byte-level BPE tokenizer, MLM pretraining of a small BERT
with any registered attention mechanism, and SST-2 / QQP / MNLI / QNLI fine-tuning.

Entry points: ``python -m glue.pretrain`` and ``python -m glue.finetune``; the Table 4
report is ``scripts/glue_report.py``. See docs/glue.md.
"""
