# stopgate: the egress sidecar and control plane, one static binary.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/stopgate ./cmd/proxy

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home /var/lib/stopgate stopgate \
    && mkdir -p /var/lib/stopgate && chown stopgate /var/lib/stopgate && chmod 700 /var/lib/stopgate
COPY --from=build /out/stopgate /usr/local/bin/stopgate
USER stopgate
ENV STOPGATE_DATA_DIR=/var/lib/stopgate \
    STOPGATE_PROXY_ADDR=0.0.0.0:8080 \
    STOPGATE_CONTROL_ADDR=0.0.0.0:8081
VOLUME /var/lib/stopgate
EXPOSE 8080 8081
ENTRYPOINT ["stopgate"]
CMD ["serve"]
