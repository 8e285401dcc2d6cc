"""The object a communication hook receives: torch's `dist.GradBucket` protocol.

Hooks written for torch DDP (`ddp_comm_hooks.default_hooks`, PowerSGD) call
these methods, so the names and meanings follow torch's.
"""


class GradBucket:
    def __init__(self, bucket, is_last, stamped=False):
        self._bucket = bucket
        self._is_last = is_last
        self._stamped = stamped  # the step check's stamp rides behind this bucket's buffer
        self._replaced = None  # what set_buffer gave, if anything: the hook's buffer from then

    def index(self):
        """Position of this bucket in reduction order (0 is reduced first)."""
        return self._bucket.index

    def buffer(self):
        """The flat gradient buffer (sum of local gradients, not yet averaged); for
        a parameter that expects a sparse gradient, that sparse gradient itself.
        After set_buffer, the tensor given there."""
        return self._replaced if self._replaced is not None else self._bucket.buffer

    def _to_sum(self):
        """minddp's own reductions sum this: the buffer, with the step check's
        slots behind it where the stamp rides this backward (buckets.build,
        step_check.py: only on an exact sum; a codec would leave the slots to
        whatever its block holds, and int8 decodes a block with a NaN as NaN)."""
        if self._replaced is not None:
            return self._replaced
        return self._bucket.carrier if self._stamped else self._bucket.buffer

    def gradients(self):
        """Per-parameter row-major views into the buffer, shaped like the parameters
        (torch's: they ignore a parameter's own strides); none for a sparse bucket."""
        if self._bucket.sparse:
            return []
        return self._bucket.flat_slices(self.buffer().view(-1))

    def parameters(self):
        return list(self._bucket.params)

    def is_last(self):
        """True for the last bucket of the iteration (hooks use it to step state)."""
        return self._is_last

    def set_buffer(self, tensor):
        """Make `tensor` (as many elements as the buffer) the buffer from here on, as
        torch's does: buffer() and gradients() return it, in its own dtype
        (fp16_compress_wrapper reduces the bucket in fp16 through it); the reducer
        casts the hook's result back to the bucket's dtype."""
        buffer = self._bucket.buffer
        if tensor.numel() != buffer.numel():
            raise RuntimeError(f"minddp: set_buffer got {tensor.numel()} elements for bucket "
                             f"{self.index()} of {buffer.numel()}")
        self._replaced = tensor
