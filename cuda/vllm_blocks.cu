// Copy blocks of vLLM's per-layer paged KV to kvtier pages (save) and back (load), every
// layer and page of a call in one launch. Compiled at run time by CuPy (RawModule); the host
// code, which checks every argument and builds the table below, is kvtier_client/kernels_vllm.py.
//
// One row is `row_bytes` contiguous bytes (head_dim, or MLA's latent_dim, elements). Both
// sides are seen as rows indexed (kv, token, head), with n_kv = 2 (K, V) or 1 (MLA), and
// heads = the worker's kv_heads_local (1 for MLA):
//
//   engine row  = table.engine[l] + table.block[p] + kv * kv_stride + t * token_stride + h * head_stride
//   page row    = table.page[p] + table.layer[l] + ((kv * tokens + t) * heads_total + h) * row_bytes
//
// where table.block[p] = block_ids[p] * block_stride and table.layer[l] = page_layer(l) *
// page_layer_bytes + head_offset * row_bytes are precomputed by the host (all in bytes), so
// the kernel neither knows the vLLM format (it is only the strides) nor the TP slice (it is
// only the offset and heads_total). The table is one uint64 array in device memory:
//
//   [ engine[0..L) | layer[0..L) | page[0..P) | block[0..P) ]
//
// Work: blockIdx.y walks the (layer, page) items, blockIdx.x * blockDim.x + threadIdx.x the
// units of one item (n_kv * tokens * heads * units_per_row), both grid-stride, so any grid is
// correct. Consecutive threads take consecutive units of a row, then the next head: a TP
// slice of one (kv, token) is one contiguous run on the page side.
//
// A unit is UNIT bytes (16: uint4, down to 1: unsigned char); the host picks the largest
// power of two dividing row_bytes, every stride and every base address, so each access is
// aligned. Pages may be device memory or host memory mapped into the device's address space
// (cudaHostRegister'd or cudaHostAlloc'd; the table holds the device-side address): the
// kernel only loads and stores through the pointers it is given.

template <typename UNIT>
__device__ __forceinline__ void kvtier_vllm_blocks(
    unsigned long long table_address, int n_layers, int n_pages, int save,
    int n_kv, int tokens, int heads, int heads_total, int units_per_row,
    long long kv_stride, long long token_stride, long long head_stride, long long row_bytes)
{
    const unsigned long long* table = reinterpret_cast<const unsigned long long*>(table_address);
    const unsigned long long* engine_ptrs = table;
    const unsigned long long* layer_offsets = table + n_layers;
    const unsigned long long* page_ptrs = table + 2 * n_layers;
    const unsigned long long* block_offsets = table + 2 * n_layers + n_pages;

    const unsigned int per_item = (unsigned int)n_kv * tokens * heads * units_per_row;  // < 2^31 (host checks)
    const unsigned int items = (unsigned int)n_layers * n_pages;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int item = blockIdx.y; item < items; item += gridDim.y) {
        const unsigned int layer = item / n_pages;
        const unsigned int page = item - layer * n_pages;
        unsigned char* engine = reinterpret_cast<unsigned char*>(engine_ptrs[layer] + block_offsets[page]);
        unsigned char* paged = reinterpret_cast<unsigned char*>(page_ptrs[page] + layer_offsets[layer]);
        for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < per_item; i += stride) {
            unsigned int rest = i / units_per_row;
            const unsigned int unit = i - rest * units_per_row;
            const unsigned int h = rest % heads;
            rest /= heads;
            const unsigned int t = rest % tokens;
            const unsigned int kv = rest / tokens;
            const long long unit_bytes = (long long)unit * (long long)sizeof(UNIT);
            UNIT* e = reinterpret_cast<UNIT*>(
                engine + kv * kv_stride + t * token_stride + h * head_stride + unit_bytes);
            UNIT* g = reinterpret_cast<UNIT*>(
                paged + ((long long)(kv * tokens + t) * heads_total + h) * row_bytes + unit_bytes);
            if (save) {
                *g = *e;
            } else {
                *e = *g;
            }
        }
    }
}

#define KVTIER_VLLM_BLOCKS(SUFFIX, UNIT)                                                          \
    extern "C" __global__ void kvtier_vllm_blocks_##SUFFIX(                                       \
        unsigned long long table, int n_layers, int n_pages, int save, int n_kv, int tokens,      \
        int heads, int heads_total, int units_per_row, long long kv_stride,                       \
        long long token_stride, long long head_stride, long long row_bytes)                       \
    {                                                                                             \
        kvtier_vllm_blocks<UNIT>(table, n_layers, n_pages, save, n_kv, tokens, heads,             \
                                 heads_total, units_per_row, kv_stride, token_stride,             \
                                 head_stride, row_bytes);                                         \
    }

KVTIER_VLLM_BLOCKS(v16, uint4)
KVTIER_VLLM_BLOCKS(v8, uint2)
KVTIER_VLLM_BLOCKS(v4, unsigned int)
KVTIER_VLLM_BLOCKS(v2, unsigned short)
KVTIER_VLLM_BLOCKS(v1, unsigned char)
