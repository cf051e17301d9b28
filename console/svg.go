package console

import (
	"fmt"
	"html"
	"html/template"
	"strings"
)

// Charts are drawn by the server as inline SVG: no chart library, no
// script, and the page's content policy allows them (presentation by the
// classes of console.css, no style attributes).

// stack is one bar of a stacked bar chart: its label (an x tick) and its
// parts, bottom up, each drawn in the class of its series.
type stack struct {
	Label string
	Parts []float64
	Title string // the bar's tooltip
}

// stackedBars draws bars side by side, height scaled to the tallest;
// classes name each series (bar, bar bad, ...).
func stackedBars(bars []stack, classes []string, w, h int) template.HTML {
	const left, bottom, top = 36, 18, 6
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart" viewBox="0 0 %d %d" width="%d" height="%d" role="img">`, w, h, w, h)
	max := 0.0
	for _, s := range bars {
		sum := 0.0
		for _, p := range s.Parts {
			sum += p
		}
		if sum > max {
			max = sum
		}
	}
	plotH := float64(h - bottom - top)
	fmt.Fprintf(&b, `<line class="axis" x1="%d" y1="%d" x2="%d" y2="%d"/>`, left, h-bottom, w, h-bottom)
	if max > 0 {
		fmt.Fprintf(&b, `<text x="2" y="%d">%s</text>`, top+10, trimFloat(max))
		fmt.Fprintf(&b, `<line class="grid" x1="%d" y1="%d" x2="%d" y2="%d"/>`, left, top, w, top)
	}
	if len(bars) > 0 && max > 0 {
		slot := float64(w-left) / float64(len(bars))
		barW := slot * 0.8
		tick := 1 + len(bars)/8 // at most about 8 x labels
		for i, s := range bars {
			x := float64(left) + float64(i)*slot + slot*0.1
			y := float64(h - bottom)
			fmt.Fprintf(&b, `<g><title>%s</title>`, html.EscapeString(s.Title))
			for k, p := range s.Parts {
				if p <= 0 {
					continue
				}
				ph := p / max * plotH
				y -= ph
				fmt.Fprintf(&b, `<rect class="%s" x="%.1f" y="%.1f" width="%.1f" height="%.1f"/>`, classes[k%len(classes)], x, y, barW, ph)
			}
			b.WriteString("</g>")
			if i%tick == 0 {
				fmt.Fprintf(&b, `<text x="%.1f" y="%d">%s</text>`, x, h-4, html.EscapeString(s.Label))
			}
		}
	}
	b.WriteString("</svg>")
	return template.HTML(b.String())
}

func trimFloat(f float64) string {
	s := fmt.Sprintf("%.1f", f)
	return strings.TrimSuffix(s, ".0")
}
