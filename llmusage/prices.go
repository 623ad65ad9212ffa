package llmusage

import (
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strconv"
	"strings"
)

// Price is a model's price, in pico-USD (1e-12 USD) a token: what a price
// of so many USD per million tokens is, exactly, to six decimals.
type Price struct {
	Input, Output int64
}

// ParsePerMillion reads a price in USD per million tokens ("2.50",
// "0.075", at most six decimals) as pico-USD per token.
func ParsePerMillion(s string) (int64, error) {
	s = strings.TrimSpace(s)
	whole, frac, _ := strings.Cut(s, ".")
	if s == "" || strings.HasPrefix(s, "-") || strings.HasPrefix(s, "+") || len(frac) > 6 {
		return 0, fmt.Errorf("%q is not a price in USD per million tokens like 2.50 (at most six decimals, not negative)", s)
	}
	if whole == "" {
		whole = "0"
	}
	w, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || w > 1_000_000 {
		return 0, fmt.Errorf("%q is not a price in USD per million tokens like 2.50 (at most 1000000)", s)
	}
	var f int64
	if frac != "" {
		if f, err = strconv.ParseInt(frac+strings.Repeat("0", 6-len(frac)), 10, 64); err != nil || f < 0 {
			return 0, fmt.Errorf("%q is not a price in USD per million tokens like 2.50", s)
		}
	}
	return w*1_000_000 + f, nil
}

// Prices is the operator's price table: by model name, exactly, or by a
// pattern ending in * that the name starts with (the longest wins), so
// that "gpt-4o*" prices "gpt-4o-2024-08-06" as the provider names it.
type Prices struct {
	exact    map[string]Price
	prefixes []prefixPrice
}

type prefixPrice struct {
	prefix string
	price  Price
}

// NewPrices builds the table; a pattern may end in * and nowhere else.
func NewPrices(table map[string]Price) (Prices, error) {
	p := Prices{exact: map[string]Price{}}
	for model, price := range table {
		if price.Input < 0 || price.Output < 0 {
			return Prices{}, fmt.Errorf("price of %q is negative", model)
		}
		name, wild := strings.CutSuffix(model, "*")
		if strings.Contains(name, "*") || model == "" {
			return Prices{}, fmt.Errorf("model pattern %q: a name, or a name's start followed by one *", model)
		}
		if wild {
			p.prefixes = append(p.prefixes, prefixPrice{name, price})
		} else {
			p.exact[name] = price
		}
	}
	slices.SortFunc(p.prefixes, func(a, b prefixPrice) int { return len(b.prefix) - len(a.prefix) })
	return p, nil
}

// Len is the number of entries.
func (p Prices) Len() int { return len(p.exact) + len(p.prefixes) }

// Of is model's price, false if the table does not list it.
func (p Prices) Of(model string) (Price, bool) {
	if model == "" {
		return Price{}, false
	}
	if pr, ok := p.exact[model]; ok {
		return pr, true
	}
	for _, pp := range p.prefixes {
		if strings.HasPrefix(model, pp.prefix) {
			return pp.price, true
		}
	}
	return Price{}, false
}

// Spend is the price of in and out tokens of model, in nano-USD rounded
// up (never under-counted), false for a model the table does not list.
func (p Prices) Spend(model string, in, out int64) (int64, bool) {
	pr, ok := p.Of(model)
	if !ok {
		return 0, false
	}
	pico := mulSat(in, pr.Input)
	pico = addSat(pico, mulSat(out, pr.Output))
	return pico/1000 + min(pico%1000, 1), true
}

func mulSat(a, b int64) int64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(lo)
}

func addSat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
