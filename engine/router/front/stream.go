package main

// One ext_proc stream (one HTTP request through the gateway), the same state machine as the
// router's own Python picker (engine/router/extproc_stream.py): the whole request body is
// gathered (BUFFERED, or FULL_DUPLEX_STREAMED with or without trailers), the router picks, and
// the answer routes (destination header + envoy.lb metadata) or refuses (an immediate response
// the router wrote). The response is told to the router as it passes, never waited on.

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
)

const (
	destinationHeader = "x-gateway-destination-endpoint"
	servedHeader      = "x-gateway-destination-endpoint-served"
	lbNamespace       = "envoy.lb"
	subsetNamespace   = "envoy.lb.subset_hint"
	subsetKey         = "x-gateway-destination-endpoint-subset"
	pickIDHeader      = "x-kvmesh-pick"
)

const (
	modeNone       = filterv3.ProcessingMode_NONE
	modeBuffered   = filterv3.ProcessingMode_BUFFERED
	modeFullDuplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
)

type pickStream struct {
	p        *processor
	done     <-chan struct{}
	reqMode  filterv3.ProcessingMode_BodySendMode
	respMode filterv3.ProcessingMode_BodySendMode
	config   bool
	headers  map[string]string
	subset   []byte
	body     []byte
	decided  bool
	refused  bool
	id       uint64 // the router's name for this request's pick (0: none holds load)
	address  string
	pickID   string

	observed     atomic.Bool // an observer stream owns the response half
	responseSeen atomic.Bool
	ended        atomic.Bool
}

type answers = []*extprocv3.ProcessingResponse

func (s *pickStream) handle(req *extprocv3.ProcessingRequest) answers {
	if !s.config && req.GetProtocolConfig() != nil {
		s.config = true
		s.reqMode = req.GetProtocolConfig().GetRequestBodyMode()
		s.respMode = req.GetProtocolConfig().GetResponseBodyMode()
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return s.requestHeaders(req, r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return s.requestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if s.decided {
			if s.refused {
				return nil
			}
			return answers{emptyRequestTrailers()}
		}
		out := s.answerWholeBody(false)
		if s.refused {
			return out
		}
		return append(out, emptyRequestTrailers())
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		s.responseHeaders(req)
		return answers{{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		s.responseBody(r.ResponseBody)
		if s.respMode == modeFullDuplex {
			return answers{streamedBody(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream(), false)}
		}
		return answers{{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		s.end("")
		return answers{{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}}
	default:
		return s.decide(&toRouter{Problem: "empty_message"}, nil)
	}
}

func (s *pickStream) requestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) answers {
	if s.decided {
		return answers{{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}}
	}
	s.headers = headerMap(h)
	s.subset = subsetHint(req.GetMetadataContext())
	if s.reqMode != modeNone && s.reqMode != modeBuffered && s.reqMode != modeFullDuplex {
		return s.decide(&toRouter{}, nil) // the router explains the body mode it cannot pick in
	}
	if n, err := strconv.Atoi(s.headers["content-length"]); err == nil && n > s.p.maxBody {
		return s.decide(&toRouter{TooLarge: n}, nil)
	}
	if h.GetEndOfStream() || s.reqMode == modeNone {
		return s.decide(&toRouter{}, func(a *fromRouter) answers { return answers{s.headersAnswer(a)} })
	}
	if s.reqMode == modeBuffered {
		return answers{{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}}
	}
	return nil // full duplex: the headers' answer carries the pick, once the body is whole
}

func (s *pickStream) requestBody(b *extprocv3.HttpBody) answers {
	if s.decided {
		if s.refused {
			return nil
		}
		if s.reqMode == modeFullDuplex {
			return answers{streamedBody(b.GetBody(), b.GetEndOfStream(), true)}
		}
		return answers{{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}}
	}
	if len(s.body)+len(b.GetBody()) > s.p.maxBody {
		return s.decide(&toRouter{TooLarge: len(s.body) + len(b.GetBody())}, nil)
	}
	s.body = append(s.body, b.GetBody()...)
	if !b.GetEndOfStream() {
		return nil
	}
	return s.answerWholeBody(true)
}

func (s *pickStream) answerWholeBody(endOfStream bool) answers {
	return s.decide(&toRouter{}, func(a *fromRouter) answers {
		if s.reqMode == modeFullDuplex {
			body := s.body
			if a.Changed {
				body = a.Body
			}
			return answers{s.headersAnswer(a), streamedBody(body, endOfStream, true)}
		}
		common := s.mutation(a)
		if a.Changed {
			common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: a.Body}}
		}
		return answers{{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}},
			DynamicMetadata: destinationMetadata(a.Address)}}
	})
}

// decide asks the router; routed answers come from route, a refusal is the router's own.
func (s *pickStream) decide(msg *toRouter, route func(*fromRouter) answers) answers {
	s.decided = true
	msg.T, msg.ID = "pick", s.p.router.newID()
	msg.Headers, msg.Subset, msg.Mode = s.headers, s.subset, int32(s.reqMode)
	if msg.TooLarge == 0 {
		msg.Body = s.body // a refusal for size needs no body
	}
	a, err := s.p.router.ask(s.done, msg)
	if err != nil {
		s.refused = true
		return answers{unreachable(err)}
	}
	if a.T != "route" || route == nil {
		s.refused = true
		if a.T == "route" { // the router never routes what the front asks it to refuse: a version mismatch
			s.p.router.tell(&toRouter{T: "end", ID: msg.ID, Outcome: "aborted"})
			return answers{unreachable(errors.New("the router answered a refusal with a route"))}
		}
		return answers{immediate(a)}
	}
	s.id, s.address = msg.ID, a.Address
	s.pickID = s.p.picks.register(s)
	return route(a)
}

func (s *pickStream) mutation(a *fromRouter) *extprocv3.CommonResponse {
	sets := [][2]string{{destinationHeader, a.Address}, {pickIDHeader, s.pickID}}
	if a.Changed {
		sets = append(sets, [2]string{"content-length", strconv.Itoa(len(a.Body))})
	}
	return &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: setHeaders(sets)},
		ClearRouteCache: true}
}

func (s *pickStream) headersAnswer(a *fromRouter) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: s.mutation(a)}},
		DynamicMetadata: destinationMetadata(a.Address)}
}

// ---- the response (from this stream, or from an observer stream that claimed the pick) ----

func (s *pickStream) responseHeaders(req *extprocv3.ProcessingRequest) {
	s.responseSeen.Store(true)
	if s.id == 0 {
		return
	}
	h := headerMap(req.GetResponseHeaders())
	status, _ := strconv.Atoi(h[":status"])
	served := strings.TrimSpace(h[servedHeader])
	if served == "" {
		if ns := req.GetMetadataContext().GetFilterMetadata()[lbNamespace]; ns != nil {
			served = strings.TrimSpace(ns.GetFields()[servedHeader].GetStringValue())
		}
	}
	eos := req.GetResponseHeaders().GetEndOfStream()
	s.p.router.tell(&toRouter{T: "resp", ID: s.id, Status: status, ContentType: h["content-type"], Served: served, EOS: eos})
	if eos {
		s.ended.Store(true)
		s.p.picks.discard(s.pickID)
	}
}

func (s *pickStream) responseBody(b *extprocv3.HttpBody) {
	s.responseSeen.Store(true)
	if s.id == 0 || s.ended.Load() {
		return
	}
	s.p.router.tell(&toRouter{T: "chunk", ID: s.id, Body: b.GetBody(), EOS: b.GetEndOfStream()})
	if b.GetEndOfStream() {
		s.ended.Store(true)
		s.p.picks.discard(s.pickID)
	}
}

// end tells the router the request is over ("": a whole response, "aborted": it was abandoned);
// once per pick, whichever path sees the end first.
func (s *pickStream) end(outcome string) {
	if s.id == 0 || !s.ended.CompareAndSwap(false, true) {
		return
	}
	s.p.picks.discard(s.pickID)
	s.p.router.tell(&toRouter{T: "end", ID: s.id, Outcome: outcome})
}

// close: the gRPC stream ended. As in the Python picker (PickerStream.close): a response an
// observer stream is to follow waits for it (or the orphan timer); otherwise the request was
// abandoned.
func (s *pickStream) close(clean bool) {
	if s.observed.Load() || s.id == 0 || s.ended.Load() {
		return
	}
	observerOwned := clean || s.respMode == modeNone
	if observerOwned && !s.responseSeen.Load() {
		s.p.picks.orphan(s.pickID)
		return
	}
	s.end("aborted")
}

// ---- picks an observer stream may claim ----

type pickRegistry struct {
	ttl  time.Duration
	mu   sync.Mutex
	byID map[string]*pickStream
}

func (r *pickRegistry) register(s *pickStream) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	r.mu.Lock()
	r.byID[id] = s
	r.mu.Unlock()
	return id
}

func (r *pickRegistry) take(id string) *pickStream {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byID[id]
	delete(r.byID, id)
	return s
}

func (r *pickRegistry) claim(id string) *pickStream {
	s := r.take(id)
	if s != nil {
		s.observed.Store(true)
	}
	return s
}

func (r *pickRegistry) discard(id string) { r.take(id) }

func (r *pickRegistry) orphan(id string) {
	time.AfterFunc(r.ttl, func() {
		if s := r.take(id); s != nil {
			s.end("aborted")
		}
	})
}

// ---- messages ----

func headerMap(h *extprocv3.HttpHeaders) map[string]string {
	out := map[string]string{}
	for _, hv := range h.GetHeaders().GetHeaders() {
		v := hv.GetValue()
		if v == "" {
			v = string(hv.GetRawValue())
		}
		out[strings.ToLower(hv.GetKey())] = v
	}
	return out
}

// subsetHint is the gateway's candidate list as sent (JSON), for the router to read; nil: none.
func subsetHint(md *corev3.Metadata) []byte {
	ns := md.GetFilterMetadata()[subsetNamespace]
	if ns == nil {
		return nil
	}
	v, ok := ns.GetFields()[subsetKey]
	if !ok {
		return nil
	}
	raw, err := protojson.Marshal(v)
	if err != nil {
		return []byte(`{}`) // not a list or string: the router refuses it
	}
	return raw
}

func setHeaders(kv [][2]string) []*corev3.HeaderValueOption {
	out := make([]*corev3.HeaderValueOption, 0, len(kv))
	for _, p := range kv {
		out = append(out, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: p[0], RawValue: []byte(p[1])},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD})
	}
	return out
}

func destinationMetadata(address string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{lbNamespace: structpb.NewStructValue(
		&structpb.Struct{Fields: map[string]*structpb.Value{destinationHeader: structpb.NewStringValue(address)}})}}
}

func streamedBody(body []byte, eos bool, request bool) *extprocv3.ProcessingResponse {
	answer := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: eos}}}}}
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: answer}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: answer}}
}

func immediate(a *fromRouter) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode(a.Status)}, Headers: &extprocv3.HeaderMutation{SetHeaders: setHeaders(a.Headers)},
		Body: a.Body, Details: a.Details}}}
}

// unreachable is the one answer the front writes itself: without its router it cannot pick.
func unreachable(err error) *extprocv3.ProcessingResponse {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": "the endpoint picker cannot reach its kvmesh router (" + err.Error() + "); retry shortly",
		"type":    "service_unavailable", "param": nil, "code": "picker_unavailable"}})
	return immediate(&fromRouter{Status: 503, Body: body, Details: "kvmesh_picker_picker_unavailable",
		Headers: [][2]string{{"content-type", "application/json"}, {"retry-after", "1"}}})
}

func emptyRequestTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
}
