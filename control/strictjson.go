package control

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"

	"github.com/stopgate/stopgate/refusal"
)

// checkKeys refuses what encoding/json would read silently in a way the
// caller may not mean: a key given twice in one object (encoding/json
// keeps the last, so a proxy or a log that reads the first sees another
// request than the one applied) and a key spelled in another case than the
// field it would fill (encoding/json matches case-insensitively). The CDP
// guard refuses duplicate members the same way. It leaves syntax errors to
// the decoder, which names them better.
func checkKeys(data []byte, t reflect.Type) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	err := checkValue(dec, t, "")
	var r *refusal.Refusal
	if errors.As(err, &r) {
		return r
	}
	return nil
}

// checkValue reads one value from dec, checking the keys of every object
// in it against t, the Go type it fills (nil when unknown: keys are then
// checked for duplicates only). path names the value in messages.
func checkValue(dec *json.Decoder, t reflect.Type, path string) error {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch d {
	case '[':
		var elem reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			elem = t.Elem()
		}
		for i := 0; dec.More(); i++ {
			if err := checkValue(dec, elem, path+"[]"); err != nil {
				return err
			}
		}
	case '{':
		fields := jsonFields(t)
		seen := map[string]string{}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return err
			}
			key, _ := tok.(string)
			name := path + key
			if prev, dup := seen[strings.ToLower(key)]; dup {
				if prev == key {
					return refusal.New(refusal.InvalidJSON, "invalid JSON: key %q appears twice in one object; send each field once", name)
				}
				return refusal.New(refusal.InvalidJSON, "invalid JSON: keys %q and %q differ only in case; send each field once, spelled as documented", path+prev, name)
			}
			seen[strings.ToLower(key)] = key
			var sub reflect.Type
			if fields != nil {
				exact, ok := fields[key]
				if !ok {
					for f := range fields {
						if strings.EqualFold(f, key) {
							return refusal.New(refusal.UnknownField, "unknown field %q: field names are case-sensitive; did you mean %q?", name, path+f)
						}
					}
				}
				sub = exact
			} else if t != nil && t.Kind() == reflect.Map {
				sub = t.Elem()
			}
			if err := checkValue(dec, sub, name+"."); err != nil {
				return err
			}
		}
	}
	_, err = dec.Token() // the closing delimiter
	return err
}

// jsonFields maps the JSON names of a struct type's fields to their types;
// nil for anything that is not a struct (or implements its own decoding).
func jsonFields(t reflect.Type) map[string]reflect.Type {
	if t == nil || t.Kind() != reflect.Struct || reflect.PointerTo(t).Implements(unmarshalerType) {
		return nil
	}
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = f.Type
	}
	return out
}

var unmarshalerType = reflect.TypeFor[json.Unmarshaler]()
