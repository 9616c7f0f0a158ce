"""The bundled model's workshop (not part of the apps): synthetic checkpoints and tokenizers
(`synthetic`, also used by the benchmarks and tests), the scene generator (`scenes`), the trainer
(`train`) and the caption evaluation (`eval`) of `assets/mmpipe-tiny-scenes`."""
