# The one millrace binary, for every service (deploy/kubernetes,
# deploy/compose): `docker build --build-arg VERSION=$(git describe) -t
# ghcr.io/millrace/millrace:$(git describe) .` Each container runs one
# command (`serve bes`, `project builds`, ...) as its arguments.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum go.work go.work.sum ./
COPY schemas/go.mod schemas/go.sum schemas/
RUN go mod download
COPY . .
ARG VERSION=devel
# No cgo: the binary runs on a base with no C library.
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -X main.version=${VERSION}" -o /out/millrace ./cmd/millrace

# distroless: CA certificates and tzdata, no shell; nonroot is uid 65532.
FROM gcr.io/distroless/static-debian12:nonroot
LABEL org.opencontainers.image.title="millrace" \
      org.opencontainers.image.source="https://github.com/millrace/millrace" \
      io.millrace.image="ghcr.io/millrace/millrace"
COPY --from=build /out/millrace /usr/local/bin/millrace
USER 65532:65532
# gRPC: BES 1985, fleet 1986, commits 1987, reservations 1988; HTTP
# (metrics, probes, APIs, the console): 8080-8089, one per command.
EXPOSE 1985 1986 1987 1988 8080 8081 8082 8083 8084 8085 8086 8087 8088 8089
ENTRYPOINT ["/usr/local/bin/millrace"]
