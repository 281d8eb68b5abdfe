package idem

// FlightUsers returns how many requests of h hold or wait for a key's turn:
// tests use it to know that duplicates are waiting before they go on.
func FlightUsers(h *HTTP) int {
	h.flights.mu.Lock()
	defer h.flights.mu.Unlock()
	n := 0
	for _, fl := range h.flights.m {
		n += fl.users
	}
	return n
}

// LockID is the advisory-lock id of k before ClaimKey XORs it with the
// table's oid: tests hold it to stand for a hash collision.
func LockID(k Key) int64 { return k.storageKey().lockID() }
