"""Every named random stream: the tag a stream folds into a jax key or appends to a numpy seed,
in one place so two streams can never share randomness by accident (tests/test_rng_streams.py).

jax tags (`jax.random.fold_in(key, TAG)`) split the per-step key fold_in(run key, step) into
the step's streams; numpy tags end the entropy list of `np.random.default_rng([seed, ..., TAG])`.
The tags are distinct and none is small enough to equal a micro-batch index, which the
supervised step also folds into the step key.
"""

from __future__ import annotations

# jax.random.fold_in tags.
ERASE = 0x657273  # "ers": random-erasing noise of the step (data/device_images.py)
MIX = 0x6D6978  # "mix": mixup/cutmix draws of the step (data/device_mix.py)
MAE_PICTURE = 0x9C7  # the masks of MAE's reconstruction picture, folded into PRNGKey(seed)

# numpy seed-sequence tags.
DIGIT_SCENE_ORDER = 0x5CE  # the order of the first digits of digit scenes (data/digit_scenes.py)
SEGMENTATION_PROBE = 0x5E6  # the linear-segmentation probe's crops and epoch order
HOST_BATCH = 0xBA7  # the rng a host batch transform gets: [seed, step, process, HOST_BATCH]
TEXT_ORDER = 0x7E7  # the window order of an epoch of packed text: [seed, epoch, TEXT_ORDER] (data/text.py)
TEXT_OFFSET = 0x7E0  # the window offset of an epoch (config.dataset.random_offsets): [seed, epoch, TEXT_OFFSET]

TAGS = {name: value for name, value in dict(globals()).items() if name.isupper()}
