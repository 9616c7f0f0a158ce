"""Exception types. Every error a user can cause names the input and the problem."""


class MmpipeError(Exception):
    """Base class of every error mmpipe raises on purpose."""


class InputError(MmpipeError, ValueError):
    """A request's input (image, message, prompt, parameter) is invalid."""


class ImageLoadError(InputError):
    """An image could not be read: missing, empty, corrupt, truncated or not an image."""


class VideoLoadError(InputError):
    """A video could not be read: missing, empty, corrupt, truncated, no video stream, unsupported
    codec, or shorter than asked."""


class CheckpointError(MmpipeError):
    """A model directory is incomplete or inconsistent (config, weights, tokenizer)."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture is not one mmpipe implements."""


class DeviceMemoryError(MmpipeError, MemoryError):
    """The device has too little free memory for the model and settings asked for (said with how
    much was needed and how much was free)."""


class EngineError(MmpipeError, RuntimeError):
    """The engine cannot go on (a tensor-parallel worker failed or exited); says which and why."""
