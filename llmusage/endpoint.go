package llmusage

import (
	"net/http"
	"strings"
)

// Endpoint reports whether a request to a provider of api is one whose
// answer reports usage: a POST to a generation or embedding endpoint.
// Any other request to the provider (listing models, uploading a file) is
// not an LLM call and is not metered.
func Endpoint(api API, method, path string) bool {
	if method != http.MethodPost {
		return false
	}
	path = strings.TrimSuffix(path, "/")
	switch api {
	case OpenAI:
		for _, suffix := range []string{"/chat/completions", "/completions", "/embeddings", "/responses"} {
			if strings.HasSuffix(path, suffix) {
				return true
			}
		}
	case Anthropic:
		return strings.HasSuffix(path, "/messages")
	}
	return false
}

// LooksLikeLLM reports whether a request to a host that no provider entry
// lists is an LLM call all the same, by the path the common APIs share:
// its usage is not read (the host's API is not known) and counts as
// unknown, never as zero.
func LooksLikeLLM(method, path string) bool {
	if method != http.MethodPost {
		return false
	}
	path = strings.TrimSuffix(path, "/")
	for _, suffix := range []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
		":generateContent", ":streamGenerateContent"} {
		if strings.HasSuffix(path, suffix) {
			return true
		}
	}
	return false
}
