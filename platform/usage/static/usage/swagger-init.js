/* Swagger UI of /api/v1/docs (templates/api/swagger.html): a static file, not an inline script, so the page
   runs under the Content-Security-Policy "script-src 'self'". The schema URL comes from data-schema-url. */
(function () {
  "use strict";
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.schemaUrl, dom_id: "#swagger-ui", deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout",
    validatorUrl: null,  // never ask an outside validator (and the CSP allows no other origin)
    requestInterceptor: (req) => { req.headers["X-CSRFToken"] = (document.cookie.match(/csrftoken=([^;]+)/) || [])[1] || ""; return req; },
  });
})();
