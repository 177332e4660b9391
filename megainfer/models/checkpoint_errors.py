"""What a checkpoint that does not fit the model raises: ``CheckpointError`` subclasses whose
message names the tensor and the file."""


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; the message names the tensor and the file."""


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


class ConfigMismatchError(CheckpointError):
    pass
