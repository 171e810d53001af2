"""The copy of one piece's byte range inside a Triton program, shared by the range kernel (``_batched_copy``)
and, with the piece's descriptor loads (``_copy_segment``), by the segment and grid kernels: 16-byte vector
tiles when both ends are 16-byte aligned; otherwise, with SHIFT, 8-byte words assembled from two aligned source
words (a funnel shift), else bytes; int64 offsets from a 16-byte aligned anchor pointer. With SHIFT, a piece
whose two ends are equally misaligned takes a byte head and then 16-byte vectors."""
import triton
import triton.language as tl


@triton.jit
def _copy_bytes(anchor, src, dst, n, TAIL_BLOCK: tl.constexpr):
    # n bytes, one byte per lane.
    byte_offs = tl.arange(0, TAIL_BLOCK)
    for off in range(0, n, TAIL_BLOCK):
        mask = byte_offs < n - off
        tl.store(anchor + dst + off + byte_offs, tl.load(anchor + src + off + byte_offs, mask=mask), mask=mask)


@triton.jit
def _copy_shifted(anchor, src, dst, n, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    # n bytes whose source and destination differ in alignment. After a head that 8-byte aligns the
    # destination, destination word k is bytes [8k + r, 8k + r + 8) past the 8-byte aligned source word a:
    # (word[a + k] >> 8r) | (word[a + k + 1] << (64 - 8r)), little-endian. Word a + k + 1 of the last k holds the
    # source's last body byte whenever r > 0, so no load leaves the 8-byte granules the piece touches; r == 0
    # (both ends 8-byte aligned) does not load it.
    head = tl.minimum((0 - dst) & 7, n)
    _copy_bytes(anchor, src, dst, head, 8)
    src = src + head
    dst = dst + head
    n = n - head
    words = n >> 3
    r = src & 7
    words_ptr = anchor.to(tl.pointer_type(tl.uint64))
    a = (src - r) >> 3  # source word index (the anchor is 16-byte aligned)
    d = dst >> 3
    right = (r * 8).to(tl.uint64)
    left = ((64 - r * 8) & 63).to(tl.uint64)
    hi_words = tl.where(r != 0, words, 0)  # r == 0: the second word is not needed, and not loaded
    k_offs = tl.arange(0, BLOCK // 8)
    for k0 in range(0, words, BLOCK // 8):
        k = k0 + k_offs
        mask = k < words
        lo = tl.load(words_ptr + a + k, mask=mask, other=0)
        hi = tl.load(words_ptr + a + k + 1, mask=k < hi_words, other=0)
        tl.store(words_ptr + d + k, (lo >> right) | (hi << left), mask=mask)
    body = words << 3
    _copy_bytes(anchor, src + body, dst + body, n - body, TAIL_BLOCK)


@triton.jit
def _copy_coaligned(anchor, src, dst, n, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    # n >= 16 bytes whose two ends share their offset within 16 bytes: a byte head up to the boundary, then
    # 16-byte vectors. ``x // 16 * 16`` states the alignment in a form the compiler tracks (the values are
    # multiples of 16 already; a hint on a function parameter would be dropped).
    head = (0 - src) & 15
    _copy_bytes(anchor, src, dst, head, 16)
    src = (src + head) // 16 * 16
    dst = (dst + head) // 16 * 16
    n = n - head
    body = n // 16 * 16
    vec_offs = tl.arange(0, BLOCK)
    for off in range(0, body, BLOCK):
        mask = vec_offs < body - off
        tl.store(anchor + dst + off + vec_offs, tl.load(anchor + src + off + vec_offs, mask=mask), mask=mask)
    _copy_bytes(anchor, src + body, dst + body, n - body, TAIL_BLOCK)


@triton.jit
def _copy_piece(anchor, src_base, src_i, dst_base, dst_i, begin, n,
                BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr, SHIFT: tl.constexpr = False):
    # n > 0 bytes from anchor + src to anchor + dst (int64 offsets). 16-byte vector tiles when both ends are
    # 16-byte aligned, then a byte-wide remainder. The offsets are computed here, not passed in: tl.multiple_of
    # marks the operation that defines a value, and a function parameter has none (the hint would be dropped
    # silently and the PTX would have byte loads only; checked with triton.compile for sm_90).
    src = src_base + src_i + begin
    dst = dst_base + dst_i + begin
    vec_offs = tl.arange(0, BLOCK)
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
        _copy_bytes(anchor, src + body, dst + body, n - body, TAIL_BLOCK)
    elif SHIFT:
        if n < 64:
            _copy_bytes(anchor, src, dst, n, TAIL_BLOCK)
        elif ((src ^ dst) & 15) == 0:
            _copy_coaligned(anchor, src, dst, n, BLOCK, TAIL_BLOCK)
        else:
            _copy_shifted(anchor, src, dst, n, BLOCK, TAIL_BLOCK)
    else:
        _copy_bytes(anchor, src, dst, n, TAIL_BLOCK)


@triton.jit
def _copy_segment(anchor, src_index, dst_index, lengths, src_base, dst_base, item, begin,
                  SEG: tl.constexpr, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    # Bytes [begin, begin + SEG) of piece ``item``, clipped to its length: what one program of the segment and
    # grid kernels copies. The three descriptor loads depend on ``item`` only: one round trip before the data.
    length = tl.load(lengths + item)
    src_i = tl.load(src_index + item)
    dst_i = tl.load(dst_index + item)
    n = tl.minimum(length - begin, SEG)
    if n > 0:
        _copy_piece(anchor, src_base, src_i, dst_base, dst_i, begin, n, BLOCK, TAIL_BLOCK, False, SHIFT)
