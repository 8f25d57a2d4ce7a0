// Batched page copy between two page arenas, compiled at run time by CuPy (RawModule).
//
// One launch copies every (src page, dst page) pair in `pairs`:
//
//     dst + pairs[2*i+1] * page_bytes  <-  src + pairs[2*i] * page_bytes,  page_bytes bytes
//
// Work is a flat index over (pair, 16-byte chunk), walked grid-stride, so any grid size is
// correct and the launcher only picks one that fills the device. Every access is one uint4
// (16 bytes): the caller guarantees both arena bases are 16-byte aligned and page_bytes is a
// multiple of 16 (kvtier_client.kernels.copy_pages_gpu checks both, and that every index
// is in range and no destination page repeats). Host code lives in kernels.py, none here.

extern "C" __global__ void kvtier_copy_pages(
    const unsigned char* __restrict__ src,
    unsigned char* __restrict__ dst,
    const long long* __restrict__ pairs,  // [n_pairs, 2]: (src page, dst page)
    long long n_pairs,
    long long page_bytes)                 // a multiple of 16
{
    const long long chunks = page_bytes >> 4;  // uint4 per page
    const long long total = n_pairs * chunks;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long pair = i / chunks;
        const long long chunk = i - pair * chunks;
        const uint4* s = reinterpret_cast<const uint4*>(src + pairs[2 * pair] * page_bytes) + chunk;
        uint4* d = reinterpret_cast<uint4*>(dst + pairs[2 * pair + 1] * page_bytes) + chunk;
        *d = *s;
    }
}
