"""GLUE configs: ``configs/glue/{pretrain,finetune}.py:<mechanism>[,<scale>]``."""
