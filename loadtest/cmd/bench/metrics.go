package main

import (
	"bufio"
	"cmp"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// promSample is one scrape of a process's /metrics: series (name and
// labels, as written) to value.
type promSample map[string]float64

// scrape reads a Prometheus text exposition; nil when it cannot.
func scrape(url string) promSample {
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	s := promSample{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		s[line[:i]] = v
	}
	return s
}

// delta is after - before for every series (counters and histograms).
func (s promSample) delta(before promSample) promSample {
	d := promSample{}
	for k, v := range s {
		d[k] = v - before[k]
	}
	return d
}

// sum adds the series of a family whose labels contain every filter.
func (s promSample) sum(name string, filters ...string) float64 {
	var t float64
	for k, v := range s {
		if seriesName(k) != name || !hasAll(k, filters) {
			continue
		}
		t += v
	}
	return t
}

func seriesName(k string) string {
	if i := strings.IndexByte(k, '{'); i >= 0 {
		return k[:i]
	}
	return k
}

func hasAll(k string, filters []string) bool {
	for _, f := range filters {
		if !strings.Contains(k, f) {
			return false
		}
	}
	return true
}

// quantileMS estimates a histogram's quantile as the upper bound of the
// bucket it falls in (Prometheus buckets are coarse: factor 2 here), in
// milliseconds; +Inf when beyond the last bucket.
func (s promSample) quantileMS(name string, q float64, filters ...string) float64 {
	type bucket struct{ le, n float64 }
	var bs []bucket
	for k, v := range s {
		if seriesName(k) != name+"_bucket" || !hasAll(k, filters) {
			continue
		}
		i := strings.Index(k, `le="`)
		if i < 0 {
			continue
		}
		rest := k[i+4:]
		le, err := strconv.ParseFloat(rest[:strings.IndexByte(rest, '"')], 64)
		if err != nil {
			continue
		}
		bs = append(bs, bucket{le, v})
	}
	if len(bs) == 0 {
		return 0
	}
	slices.SortFunc(bs, func(a, b bucket) int { return cmp.Compare(a.le, b.le) })
	total := bs[len(bs)-1].n
	if total <= 0 {
		return 0
	}
	for _, b := range bs {
		if b.n >= q*total {
			if math.IsInf(b.le, 1) {
				return math.Inf(1)
			}
			return round(b.le*1000, 3)
		}
	}
	return math.Inf(1)
}

// serverFigures are what the edge and projector say about themselves over
// a run (deltas of their /metrics).
type serverFigures struct {
	// EdgeAckP50MS/P99MS: the edge's own time from receiving an event to
	// sending its ack (bucket upper bounds, factor-2 buckets).
	EdgeAckP50MS float64 `json:"edge_ack_p50_ms"`
	EdgeAckP99MS float64 `json:"edge_ack_p99_ms"`
	// PublishP99MS: publish to JetStream's store acknowledgement.
	PublishP50MS float64 `json:"publish_p50_ms"`
	PublishP99MS float64 `json:"publish_p99_ms"`
	// Projector: batches committed, events per batch, and mean time per
	// step of the consumer loop.
	Batches        float64            `json:"projector_batches,omitempty"`
	EventsPerBatch float64            `json:"projector_events_per_batch,omitempty"`
	StepMeanMS     map[string]float64 `json:"projector_step_mean_ms,omitempty"`
	StepTotalS     map[string]float64 `json:"projector_step_total_s,omitempty"`
}

func serverReport(edge, proj promSample) *serverFigures {
	f := &serverFigures{}
	if edge != nil {
		f.EdgeAckP50MS = finite(edge.quantileMS("millrace_bes_ack_seconds", 0.5))
		f.EdgeAckP99MS = finite(edge.quantileMS("millrace_bes_ack_seconds", 0.99))
		f.PublishP50MS = finite(edge.quantileMS("millrace_publish_seconds", 0.5))
		f.PublishP99MS = finite(edge.quantileMS("millrace_publish_seconds", 0.99))
	}
	if proj != nil {
		f.Batches = proj.sum("millrace_consumer_batches_total", `kind="projection"`, `result="committed"`)
		if f.Batches > 0 {
			f.EventsPerBatch = round(proj.sum("millrace_consumer_messages_total", `kind="projection"`)/f.Batches, 1)
		}
		f.StepMeanMS, f.StepTotalS = map[string]float64{}, map[string]float64{}
		for _, step := range []string{"fetch", "apply_commit", "ack"} {
			sel := `step="` + step + `"`
			n := proj.sum("millrace_consumer_step_seconds_count", `kind="projection"`, sel)
			t := proj.sum("millrace_consumer_step_seconds_sum", `kind="projection"`, sel)
			if n > 0 {
				f.StepMeanMS[step] = round(t/n*1000, 2)
				f.StepTotalS[step] = round(t, 2)
			}
		}
	}
	return f
}

// finite keeps JSON valid: +Inf (beyond the last bucket) becomes -1.
func finite(v float64) float64 {
	if math.IsInf(v, 0) || math.IsNaN(v) {
		return -1
	}
	return v
}
