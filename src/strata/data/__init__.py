"""Files shipped with the package: the synth tokenizer and the default chat template."""
