"""The layer-wise solver shared by pruning and quantization, below both (no Flower import):
choosing the lowest scores of a comparison group (:mod:`fedcompress.solver.select`, with its
compiled radix select :mod:`fedcompress.solver.radix`) and the optimal-brain-surgeon sweep of
SparseGPT and GPTQ (:mod:`fedcompress.solver.obs`). ``fedcompress.pruning`` and
``fedcompress.quant`` import it; it imports neither."""
