"""The presets, importable (``configs.synthetic``) and shipped in the wheel so that
``sbm-train --config=synthetic:quick`` finds them by name."""
