from enum import Enum


class AttnType(Enum):
    FA = "fa"
    FA3 = "fa3"
    TORCH_MATH = "torch_math"
    TORCH_FLASH = "torch_flash"
    TORCH_EFFICIENT = "torch_efficient"
    TORCH_CUDNN = "torch_cudnn"
