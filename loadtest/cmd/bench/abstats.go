package main

import (
	"encoding/json"
	"math"
	"slices"
)

// The statistics of an A/B comparison. Each figure has a few values per
// binary (one per round); the question is whether B's differ from A's by
// more than the rounds of either differ among themselves.

// abNoiseRule is written into every A/B report, so that a reader of the
// JSON knows what "within noise" meant.
const abNoiseRule = "per binary, median of its rounds and spread = (max - min) / |median| of its rounds; " +
	"noise = the larger of A's and B's spread; within noise when |B median / A median - 1| <= noise. " +
	"A median of 0: the ratio is 1 when both medians are 0, unbounded (null) otherwise; " +
	"a spread is unbounded (null) when its median is 0 and its rounds differ"

// Verdicts of a figure.
const (
	verdictWithin = "within noise"
	verdictHigher = "B higher"
	verdictLower  = "B lower"
	verdictOnlyA  = "only in A"
	verdictOnlyB  = "only in B"
)

// jfloat is a float64 that an infinity makes null in JSON (encoding/json
// refuses infinities); ratios and spreads are unbounded when a median is 0.
type jfloat float64

func (f jfloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if math.IsInf(v, 0) || math.IsNaN(v) {
		return []byte("null"), nil
	}
	return json.Marshal(round(v, 4))
}

// abStats are one binary's values of one figure, in the order of its rounds.
type abStats struct {
	Values []float64 `json:"values"`
	Median float64   `json:"median"`
	Min    float64   `json:"min"`
	Max    float64   `json:"max"`
	// Spread is (Max - Min) / |Median|: the rounds' own noise.
	Spread jfloat `json:"spread"`
}

func statsOf(xs []float64) abStats {
	s := abStats{Values: xs}
	if len(xs) == 0 {
		return s
	}
	// The median of an even count is a mean: rounded, so that the JSON
	// does not show the float's last bits.
	s.Median, s.Min, s.Max = round(median(xs), 6), slices.Min(xs), slices.Max(xs)
	switch {
	case s.Max == s.Min:
		s.Spread = 0
	case s.Median == 0:
		s.Spread = jfloat(math.Inf(1))
	default:
		s.Spread = jfloat((s.Max - s.Min) / math.Abs(s.Median))
	}
	return s
}

// abFigure is one figure compared between the binaries.
type abFigure struct {
	Name string  `json:"name"`
	Unit string  `json:"unit,omitempty"`
	A    abStats `json:"a"`
	B    abStats `json:"b"`
	// Ratio is B's median over A's; Noise the larger spread (abNoiseRule).
	Ratio   jfloat `json:"ratio_b_over_a"`
	Noise   jfloat `json:"noise"`
	Verdict string `json:"verdict"`
}

// compareFigure applies abNoiseRule to one figure's values.
func compareFigure(name, unit string, a, b []float64) abFigure {
	f := abFigure{Name: name, Unit: unit, A: statsOf(a), B: statsOf(b)}
	switch {
	case len(a) == 0:
		f.Verdict = verdictOnlyB
		return f
	case len(b) == 0:
		f.Verdict = verdictOnlyA
		return f
	}
	f.Ratio = jfloat(ratioOf(f.A.Median, f.B.Median))
	f.Noise = max(f.A.Spread, f.B.Spread)
	r := float64(f.Ratio)
	switch {
	case math.Abs(r-1) <= float64(f.Noise):
		f.Verdict = verdictWithin
	case r > 1:
		f.Verdict = verdictHigher
	default:
		f.Verdict = verdictLower
	}
	return f
}

// ratioOf is b/a; a of 0 makes it 1 when b is 0 too, else infinite with
// b's sign (so that the verdict still says which way B went).
func ratioOf(a, b float64) float64 {
	if a != 0 {
		return b / a
	}
	switch {
	case b == 0:
		return 1
	case b > 0:
		return math.Inf(1)
	default:
		return math.Inf(-1)
	}
}

// abSide is which binary a run used.
type abSide string

const (
	sideA abSide = "A"
	sideB abSide = "B"
)

// abOrder is the order of the 2 × rounds runs of a scenario: pairs
// alternately A B and B A (A B B A A B ...), so that a drift of the
// machine over the runs (other work starting or stopping, a warming page
// cache) weighs on both binaries alike instead of on the one that always
// runs second.
func abOrder(rounds int) []abSide {
	order := make([]abSide, 0, 2*rounds)
	for i := range rounds {
		if i%2 == 0 {
			order = append(order, sideA, sideB)
		} else {
			order = append(order, sideB, sideA)
		}
	}
	return order
}
