// Gather an engine's per-layer KV tensors into page-first pages, and scatter them back.
// Compiled at run time by CuPy (RawModule); host code lives in kvtier_client/kernels.py.
//
// Engine side, one tensor per layer l (all the same shape and dtype, C-contiguous):
//     layer[l] : [num_blocks, 2, block_tokens, kv_heads, head_dim]
// Page side, one page per pair (page i starts at pages + i * page_bytes):
//     page     : [layers, 2, block_tokens, kv_heads, head_dim]
//
// For a fixed (layer l, k/v half kv) both sides hold the same contiguous run of
//     row_bytes = block_tokens * kv_heads * head_dim * itemsize
// bytes, so a (block b, page p) pair is 2 * layers row copies:
//
//     layer[l] + (b * 2 + kv) * row_bytes   <->   pages + p * page_bytes + (l * 2 + kv) * row_bytes
//     with page_bytes = layers * 2 * row_bytes
//
// The element size only enters through row_bytes: the kernels move bytes, so float16,
// bfloat16, float32, float8 and int8 are all the same to them. Work is a flat index over
// (pair, layer, k/v, unit), walked grid-stride. `_v16` kernels move one uint4 per unit and
// need row_bytes % 16 == 0 and every base pointer 16-byte aligned; `_b1` kernels move one
// byte per unit and need nothing. The launcher picks one; both give the same bytes.

template <typename T, bool GATHER>
__device__ __forceinline__ void kvtier_move_rows(
    const unsigned long long* __restrict__ layer_ptrs,  // [layers] device addresses
    unsigned char* __restrict__ pages,
    const long long* __restrict__ pairs,                // [n_pairs, 2]: (block id, page index)
    long long n_pairs,
    int layers,
    long long row_bytes)
{
    const long long units = row_bytes / (long long)sizeof(T);  // T per (layer, k/v) row
    const long long rows_per_pair = 2LL * layers;
    const long long total = n_pairs * rows_per_pair * units;
    const long long stride = (long long)gridDim.x * blockDim.x;
    T* page_base = reinterpret_cast<T*>(pages);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long row = i / units;
        const long long unit = i - row * units;
        const long long pair = row / rows_per_pair;
        const long long lkv = row - pair * rows_per_pair;  // l * 2 + kv
        const long long layer = lkv >> 1;
        const long long kv = lkv & 1;
        const long long block = pairs[2 * pair];
        const long long page = pairs[2 * pair + 1];
        T* engine = reinterpret_cast<T*>(layer_ptrs[layer]) + (block * 2 + kv) * units + unit;
        T* paged = page_base + (page * rows_per_pair + lkv) * units + unit;
        if (GATHER) {
            *paged = *engine;
        } else {
            *engine = *paged;
        }
    }
}

extern "C" __global__ void kvtier_gather_v16(
    const unsigned long long* layer_ptrs, unsigned char* pages, const long long* pairs,
    long long n_pairs, int layers, long long row_bytes)
{
    kvtier_move_rows<uint4, true>(layer_ptrs, pages, pairs, n_pairs, layers, row_bytes);
}

extern "C" __global__ void kvtier_gather_b1(
    const unsigned long long* layer_ptrs, unsigned char* pages, const long long* pairs,
    long long n_pairs, int layers, long long row_bytes)
{
    kvtier_move_rows<unsigned char, true>(layer_ptrs, pages, pairs, n_pairs, layers, row_bytes);
}

extern "C" __global__ void kvtier_scatter_v16(
    const unsigned long long* layer_ptrs, unsigned char* pages, const long long* pairs,
    long long n_pairs, int layers, long long row_bytes)
{
    kvtier_move_rows<uint4, false>(layer_ptrs, pages, pairs, n_pairs, layers, row_bytes);
}

extern "C" __global__ void kvtier_scatter_b1(
    const unsigned long long* layer_ptrs, unsigned char* pages, const long long* pairs,
    long long n_pairs, int layers, long long row_bytes)
{
    kvtier_move_rows<unsigned char, false>(layer_ptrs, pages, pairs, n_pairs, layers, row_bytes);
}
