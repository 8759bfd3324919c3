// An expert's byte ranges read into its slot rows in one call that releases the interpreter's lock
// (edge0.io_sched.reader's fast path). The reader's Python path stays the reference: any range
// this call does not complete (an error, a short read, a layout it does not take) is reported, and
// the reader reads that expert again its own way, with its retries and typed errors.
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <climits>
#include <cstring>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

constexpr int64_t kAlign = 4096;             // O_DIRECT's alignment (io_sched/direct.py: ALIGN)
constexpr int64_t kChunk = 8 << 20;          // a bounced direct read's most bytes (direct.py: CHUNK)
constexpr int64_t kInPlaceMax = 64ll << 20;  // an in-place direct read's most bytes (IN_PLACE_MAX)

// How a tensor's file is read: buffered, direct through the bounce buffer, or direct in place.
enum Mode : int { kBuffered = 0, kBounce = 1, kInPlace = 2 };

struct Tensor {
  int fd;
  int mode;
  int64_t offset;     // file offset of expert 0's row
  int64_t row_bytes;  // one expert's bytes
  char* address;      // the slot buffer's row 0
  int64_t stride;     // bytes between its rows
  int64_t rows;       // how many it has
};

// The reading thread's page-aligned bounce buffer: two pages for the partial first and last
// pages of an in-place read, `kChunk` bytes for a bounced one.
char* bounce() {
  thread_local struct Buffer {
    char* p = nullptr;
    ~Buffer() { std::free(p); }
  } buffer;
  if (buffer.p == nullptr) buffer.p = static_cast<char*>(std::aligned_alloc(kAlign, kChunk));
  return buffer.p;
}

ssize_t preadv_all(int fd, iovec* iov, int n, int64_t offset) {
  ssize_t got;
  do got = ::preadv(fd, iov, n, offset);
  while (got < 0 && errno == EINTR);
  return got;
}

// `len` bytes of the file at `offset` into `dest`, buffered: true when all arrived.
bool read_buffered(int fd, char* dest, int64_t len, int64_t offset) {
  for (int64_t done = 0; done < len;) {
    iovec v{dest + done, size_t(len - done)};
    ssize_t n = preadv_all(fd, &v, 1, offset + done);
    if (n <= 0) return false;
    done += n;
  }
  return true;
}

// The same, direct, through the bounce buffer (each piece the aligned range around it).
bool read_bounced(int fd, char* dest, int64_t len, int64_t offset) {
  char* buf = bounce();
  if (buf == nullptr) return false;
  for (int64_t done = 0; done < len;) {
    int64_t at = offset + done, lo = at - at % kAlign;
    int64_t hi = std::min((at + (len - done) + kAlign - 1) / kAlign * kAlign, lo + kChunk);
    iovec v{buf, size_t(hi - lo)};
    ssize_t n = preadv_all(fd, &v, 1, lo);
    int64_t usable = std::min<int64_t>(n - (at - lo), len - done);
    if (n <= 0 || usable <= 0) return false;
    std::memcpy(dest + done, buf + (at - lo), size_t(usable));
    done += usable;
  }
  return true;
}

// The same, direct, in place: the whole pages between the first and the last land in `dest`
// (whose address has the offset's phase), the partial first and last pages in the bounce buffer,
// all in one read. -1: the layout does not allow it (the caller bounces); 0: failed; 1: done.
int read_in_place(int fd, char* dest, int64_t len, int64_t offset) {
  if (len < 2 * kAlign || len > kInPlaceMax || (reinterpret_cast<intptr_t>(dest) - offset) % kAlign) return -1;
  int64_t head = (kAlign - offset % kAlign) % kAlign, tail = (offset + len) % kAlign, mid = len - head - tail;
  char* buf = bounce();
  if (mid <= 0 || buf == nullptr) return -1;
  iovec v[3];
  int n = 0;
  if (head) v[n++] = {buf, size_t(kAlign)};
  v[n++] = {dest + head, size_t(mid)};
  if (tail) v[n++] = {buf + kAlign, size_t(kAlign)};
  int64_t first = head ? offset - (kAlign - head) : offset, want = offset + len - first;
  if (preadv_all(fd, v, n, first) < want) return 0;
  if (head) std::memcpy(dest, buf + kAlign - head, size_t(head));
  if (tail) std::memcpy(dest + len - tail, buf + kAlign, size_t(tail));
  return 1;
}

// Expert `e`'s rows of every tensor into slot row `r`, `count` adjacent experts into as many
// adjacent rows (adjacent in memory too: the caller's runs); false when a range did not arrive
// whole. `in_place` counts the reads that landed in place.
bool read_run(const std::vector<Tensor>& tensors, int64_t e, int64_t r, int64_t count, int64_t& in_place) {
  for (const auto& t : tensors) {
    char* dest = t.address + r * t.stride;
    int64_t len = t.row_bytes * count, offset = t.offset + e * t.row_bytes;
    if (t.mode == kInPlace) {
      int done = read_in_place(t.fd, dest, len, offset);
      if (done == 1) {
        ++in_place;
        continue;
      }
      if (done == 0) return false;
    }
    if (!(t.mode == kBuffered ? read_buffered(t.fd, dest, len, offset) : read_bounced(t.fd, dest, len, offset)))
      return false;
  }
  return true;
}

// tensors: (fd, mode, offset, row_bytes, address, stride, rows) per stacked tensor of the layer;
// experts[i] into rows[i] (a row outside a buffer is not read: reported). Returns (bytes read,
// reads that landed in place, the indices i of the experts not read whole).
std::tuple<int64_t, int64_t, std::vector<int64_t>> read_rows(
    const std::vector<std::tuple<int, int, int64_t, int64_t, uintptr_t, int64_t, int64_t>>& spec,
    const std::vector<int64_t>& experts, const std::vector<int64_t>& rows) {
  if (experts.size() != rows.size()) throw std::invalid_argument("edge0 reads: experts and rows differ in length");
  std::vector<Tensor> tensors;
  int64_t expert_bytes = 0;
  bool contiguous = true;  // every tensor's rows adjacent in memory: adjacent experts read as one range
  int64_t slots = INT64_MAX;  // rows every buffer has
  for (const auto& [fd, mode, offset, row_bytes, address, stride, held] : spec) {
    if (fd < 0 || mode < kBuffered || mode > kInPlace || offset < 0 || row_bytes <= 0 || address == 0 ||
        stride < row_bytes || held < 0)
      throw std::invalid_argument("edge0 reads: a tensor's (fd, mode, offset, row_bytes, address, stride, rows) "
                                  "is invalid");
    tensors.push_back({fd, mode, offset, row_bytes, reinterpret_cast<char*>(address), stride, held});
    slots = std::min(slots, held);
    expert_bytes += row_bytes;
    contiguous = contiguous && stride == row_bytes;
  }
  int64_t total = 0, in_place = 0;
  std::vector<int64_t> failed;
  {
    nb::gil_scoped_release release;
    for (size_t i = 0; i < experts.size();) {
      size_t n = 1;  // a run: adjacent experts into adjacent rows, one read each tensor
      while (contiguous && i + n < experts.size() && experts[i + n] == experts[i] + int64_t(n) &&
             rows[i + n] == rows[i] + int64_t(n))
        ++n;
      bool inside = experts[i] >= 0 && rows[i] >= 0 && rows[i] + int64_t(n) <= slots;  // never past a buffer
      if (inside && read_run(tensors, experts[i], rows[i], int64_t(n), in_place))
        total += expert_bytes * int64_t(n);
      else
        for (size_t j = i; j < i + n; ++j) failed.push_back(int64_t(j));
      i += n;
    }
  }
  return {total, in_place, failed};
}

}  // namespace

void bind_reads(nb::module_& m) {
  m.def("read_rows", &read_rows, "tensors"_a, "experts"_a, "rows"_a,
        "Read experts[i]'s rows of each tensor (fd, mode 0 buffered / 1 direct bounced / 2 direct in place, "
        "file offset of row 0, row bytes, buffer address, row stride, buffer rows) into rows[i]; the interpreter's "
        "lock released. Returns (bytes, in-place reads, indices of experts not read whole).");
}
