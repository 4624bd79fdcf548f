/* The layout-free weight digest (dist_sr.numerics.digest) in plain C, built into the wheel.
 *
 * It needs neither torch's headers nor a compiler where it runs: setup.py compiles it when the
 * wheel (or an editable install) is built, against Python's stable ABI only, so every process that
 * imports dist-sr digests at memory speed from its first call: a vLLM worker that never built
 * dist-sr's C++ kernel, a container without a compiler, a command that never warms anything up.
 *
 * term(i, v) = mix(i * GAMMA + v * MIX2), mix(z) = z' ^ (z' >> 32) with z' = (z ^ (z >> 29)) * MIX1,
 * where v is element i's bits read as a signed integer of the element's width (unsigned for one
 * byte) widened to 64 bits; a piece's sum is taken mod 2^64, so any split across threads, rows or
 * ranks adds up to the same value (the definition: dist_sr.numerics.digest.piece_sum_reference).
 *
 * strided_sum covers `rows` rows of `row_len` consecutive elements, row r starting `row_stride`
 * elements after row r-1 in memory and holding global indices start + r * start_stride + j.
 * The caller passes the address of a live tensor and keeps it alive; the GIL is released while
 * threads sum disjoint row ranges.
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <pthread.h>
#include <stdint.h>

#define GAMMA 0x9E3779B97F4A7C15ULL
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL
#define MAX_THREADS 64
#define MIN_PER_THREAD (1LL << 20) /* elements: below this a thread costs more than it saves */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* one binary for every x86-64 server: the loader picks the widest the CPU runs (AVX-512's 64-bit
 * multiply makes the loop about 3x faster than SSE2's emulation of it) */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define SPAN(NAME, W)                                                     \
  CLONES static uint64_t NAME(const W* w, int64_t n, uint64_t start) {    \
    uint64_t acc = 0;                                                     \
    for (int64_t j = 0; j < n; ++j) {                                     \
      uint64_t v = (uint64_t)(int64_t)w[j];                               \
      uint64_t z = (start + (uint64_t)j) * GAMMA + v * MIX2;              \
      z = (z ^ (z >> 29)) * MIX1;                                         \
      acc += z ^ (z >> 32);                                               \
    }                                                                     \
    return acc;                                                           \
  }

SPAN(span8, uint8_t)
SPAN(span16, int16_t)
SPAN(span32, int32_t)
SPAN(span64, int64_t)

typedef struct {
  const char* base;
  int64_t width, row_len, row_stride; /* row_stride in elements */
  uint64_t start, start_stride;
  int64_t row0, row1; /* rows [row0, row1) */
  int64_t j0, j1;     /* with one row: elements [j0, j1) of it */
  uint64_t sum;
} Job;

static uint64_t span(const char* p, int64_t width, int64_t n, uint64_t start) {
  switch (width) {
    case 1: return span8((const uint8_t*)p, n, start);
    case 2: return span16((const int16_t*)p, n, start);
    case 4: return span32((const int32_t*)p, n, start);
    default: return span64((const int64_t*)p, n, start);
  }
}

static void* run(void* arg) {
  Job* job = (Job*)arg;
  uint64_t acc = 0;
  for (int64_t r = job->row0; r < job->row1; ++r) {
    const char* row = job->base + (r * job->row_stride + job->j0) * job->width;
    acc += span(row, job->width, job->j1 - job->j0, job->start + (uint64_t)r * job->start_stride + (uint64_t)job->j0);
  }
  job->sum = acc;
  return NULL;
}

static PyObject* strided_sum(PyObject* self, PyObject* args) {
  unsigned long long address, start, start_stride;
  long long rows, row_len, row_stride, width;
  int threads;
  (void)self;
  if (!PyArg_ParseTuple(args, "KLLLLKKi", &address, &rows, &row_len, &row_stride, &width, &start, &start_stride,
                        &threads))
    return NULL;
  if (width != 1 && width != 2 && width != 4 && width != 8) {
    PyErr_Format(PyExc_ValueError, "dist_sr digest: element size %lld is not 1, 2, 4 or 8", width);
    return NULL;
  }
  if (rows < 0 || row_len < 0) {
    PyErr_SetString(PyExc_ValueError, "dist_sr digest: negative rows or row length");
    return NULL;
  }
  int64_t total = rows * row_len;
  int64_t t = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
  if (t > 1 && total / t < MIN_PER_THREAD) t = total / MIN_PER_THREAD > 1 ? total / MIN_PER_THREAD : 1;
  Job jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int64_t k = 0; k < t; ++k) {
    Job job = {(const char*)(uintptr_t)address, width, row_len, row_stride, start, start_stride, 0, rows, 0, row_len, 0};
    if (rows >= t) { /* split the rows */
      job.row0 = rows * k / t;
      job.row1 = rows * (k + 1) / t;
    } else { /* one (or a few) long rows: split each row's elements */
      job.j0 = row_len * k / t;
      job.j1 = row_len * (k + 1) / t;
    }
    jobs[k] = job;
  }
  uint64_t sum = 0;
  Py_BEGIN_ALLOW_THREADS
  for (int64_t k = 1; k < t; ++k) started[k] = pthread_create(&ids[k], NULL, run, &jobs[k]) == 0;
  run(&jobs[0]);
  for (int64_t k = 1; k < t; ++k) {
    if (started[k]) pthread_join(ids[k], NULL);
    else run(&jobs[k]); /* no thread to be had: sum it here */
  }
  for (int64_t k = 0; k < t; ++k) sum += jobs[k].sum;
  Py_END_ALLOW_THREADS
  return PyLong_FromUnsignedLongLong(sum);
}

static PyMethodDef methods[] = {
    {"strided_sum", strided_sum, METH_VARARGS,
     "strided_sum(address, rows, row_len, row_stride, width, start, start_stride, threads) -> digest sum mod 2^64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "digest_c", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_digest_c(void) { return PyModule_Create(&module); }
