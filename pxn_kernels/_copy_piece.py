"""The copy of one piece's byte range inside a Triton program, shared by both batched-copy kernels (the range
kernel of ``_batched_copy`` and the grid kernel of ``_grid_copy``): 16-byte vector tiles when both ends are
16-byte aligned, then a byte-wide remainder, int64 offsets from a 16-byte aligned anchor pointer."""
import triton
import triton.language as tl


@triton.jit
def _copy_piece(anchor, src_base, src_i, dst_base, dst_i, begin, n,
                BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr):
    # n > 0 bytes from anchor + src to anchor + dst (int64 offsets). 16-byte vector tiles when both ends are
    # 16-byte aligned, then a byte-wide remainder. The offsets are computed here, not passed in: tl.multiple_of
    # marks the operation that defines a value, and a function parameter has none (the hint would be dropped
    # silently and the PTX would have byte loads only; checked with triton.compile for sm_90).
    src = src_base + src_i + begin
    dst = dst_base + dst_i + begin
    vec_offs = tl.arange(0, BLOCK)
    byte_offs = tl.arange(0, TAIL_BLOCK)
    if ((src | dst) & 15) == 0:
        body = tl.multiple_of(n & -16, 16)
        full = body // BLOCK * BLOCK
        src_vec = anchor + tl.multiple_of(src, 16)
        dst_vec = anchor + tl.multiple_of(dst, 16)
        for off in range(0, full, BLOCK):  # whole tiles: no mask to compute
            if STREAMING:
                tl.store(dst_vec + off + vec_offs,
                         tl.load(src_vec + off + vec_offs, eviction_policy="evict_first"),
                         cache_modifier=".cs")
            else:
                tl.store(dst_vec + off + vec_offs, tl.load(src_vec + off + vec_offs))
        if full < body:
            mask = vec_offs < body - full
            tl.store(dst_vec + full + vec_offs, tl.load(src_vec + full + vec_offs, mask=mask), mask=mask)
        src = src + body
        dst = dst + body
        n = n - body
    for off in range(0, n, TAIL_BLOCK):
        mask = byte_offs < n - off
        tl.store(anchor + dst + off + byte_offs, tl.load(anchor + src + off + byte_offs, mask=mask), mask=mask)
