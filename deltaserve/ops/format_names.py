"""The weight formats' names (deltaserve/ops/formats.py), free of torch so that the CLI's parser can list them."""

FORMATS = ("float32", "bfloat16", "float16", "fp8", "int8", "int4")
QUANTIZATIONS = ("fp8", "int8", "int4")  # what --quantization accepts; the others are dtypes
DEFAULT_GROUP = {"fp8": 128, "int8": 32, "int4": 32}  # columns per scale
# activation_quantization (deltaserve/ops/activation_quant.py): "int8" quantizes the input rows of these
# weight formats' projections; "bf16" rounds every projection's input rows to bf16; "none" keeps every
# projection's exact float path
ACTIVATION_QUANTIZATIONS = ("int8", "bf16", "none")
INT8_ACTIVATION_WEIGHTS = ("int8", "int4")
