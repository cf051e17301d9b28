package replay

import (
	"math"
	"math/bits"
	"sync/atomic"
	"time"
)

// Histogram counts durations in log-linear buckets, the way HdrHistogram
// does with two significant digits: exact below 128 ns, then 64 buckets per
// power of two, so a reported quantile is within 1.6 % of the true value.
// It is safe for concurrent use (one atomic add per observation) and its
// size does not depend on how many values it holds.
type Histogram struct {
	counts [nBuckets]atomic.Uint64
	n      atomic.Uint64
	sum    atomic.Int64
	max    atomic.Int64
}

const (
	subBits  = 7
	subCount = 1 << subBits // exact buckets below this many ns
	half     = subCount / 2 // buckets per power of two above
	nBuckets = subCount + (64-subBits)*half
)

func bucket(v uint64) int {
	if v < subCount {
		return int(v)
	}
	shift := bits.Len64(v) - subBits
	top := v >> shift // in [half, subCount)
	return subCount + (shift-1)*half + int(top-half)
}

// bucketHigh is the largest value that falls in bucket i.
func bucketHigh(i int) uint64 {
	if i < subCount {
		return uint64(i)
	}
	j := i - subCount
	shift := j/half + 1
	top := uint64(j%half + half)
	return (top+1)<<shift - 1
}

// Record adds one duration (negative ones count as zero).
func (h *Histogram) Record(d time.Duration) {
	if d < 0 {
		d = 0
	}
	h.counts[bucket(uint64(d))].Add(1)
	h.n.Add(1)
	h.sum.Add(int64(d))
	for {
		m := h.max.Load()
		if int64(d) <= m || h.max.CompareAndSwap(m, int64(d)) {
			return
		}
	}
}

// Merge adds every observation of o to h.
func (h *Histogram) Merge(o *Histogram) {
	for i := range o.counts {
		if c := o.counts[i].Load(); c != 0 {
			h.counts[i].Add(c)
		}
	}
	h.n.Add(o.n.Load())
	h.sum.Add(o.sum.Load())
	for {
		m, om := h.max.Load(), o.max.Load()
		if om <= m || h.max.CompareAndSwap(m, om) {
			return
		}
	}
}

// Count is the number of observations.
func (h *Histogram) Count() uint64 { return h.n.Load() }

// Quantile returns the smallest bucket bound at or below which a fraction q
// of the observations fall (capped at the largest observation).
func (h *Histogram) Quantile(q float64) time.Duration {
	n := h.n.Load()
	if n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(n)))
	if rank < 1 {
		rank = 1
	}
	var seen uint64
	for i := range h.counts {
		seen += h.counts[i].Load()
		if seen >= rank {
			return min(time.Duration(bucketHigh(i)), time.Duration(h.max.Load()))
		}
	}
	return time.Duration(h.max.Load())
}

// Summary is a histogram's figures in milliseconds, for reports.
type Summary struct {
	Count  uint64  `json:"count"`
	MeanMS float64 `json:"mean_ms"`
	P50MS  float64 `json:"p50_ms"`
	P90MS  float64 `json:"p90_ms"`
	P99MS  float64 `json:"p99_ms"`
	P999MS float64 `json:"p999_ms"`
	MaxMS  float64 `json:"max_ms"`
}

// Summary returns the count, mean and quantiles.
func (h *Histogram) Summary() Summary {
	n := h.n.Load()
	if n == 0 {
		return Summary{}
	}
	ms := func(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }
	return Summary{
		Count:  n,
		MeanMS: ms(time.Duration(h.sum.Load() / int64(n))),
		P50MS:  ms(h.Quantile(0.50)),
		P90MS:  ms(h.Quantile(0.90)),
		P99MS:  ms(h.Quantile(0.99)),
		P999MS: ms(h.Quantile(0.999)),
		MaxMS:  ms(time.Duration(h.max.Load())),
	}
}
