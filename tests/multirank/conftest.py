# Import torch and torch.distributed once here, so the ranks that tests fork start fast.
import torch  # noqa: F401
import torch.distributed  # noqa: F401
