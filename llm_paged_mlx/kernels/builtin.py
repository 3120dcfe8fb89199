"""Registers the kernels that ship with the package."""

from ..hookspecs import hookimpl
from .fused import CudaKernel, MetalKernel
from .portable import PortableKernel


@hookimpl
def register_attention_kernels(register):
    register("portable", PortableKernel)
    register("cuda", CudaKernel)
    register("metal", MetalKernel)
